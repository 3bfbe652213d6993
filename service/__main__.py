"""`python -m service` / `triton-prefill`: the supervisor (see service/supervisor.py)."""

from service.supervisor import main

if __name__ == "__main__":
    main()
