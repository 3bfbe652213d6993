"""Issue 51's failure cases: a decode that never pulls, a restarted producer, a hash mismatch."""

from __future__ import annotations

from pathlib import Path

import prompts
from check import LEASE_S, Run, decode_with, ours, prefill, wait_for
from procs import Server, metric

LEASED = "prefill_kv_transfer_leased_pages"
EXPIRED = "prefill_kv_transfer_expired_requests_total"


def _said(decode: Server, since: int, pattern: str) -> str:
    """The first message of the decode's log since `since` that contains `pattern`, shortened."""
    for line in decode.log_text()[since:].splitlines():
        if pattern in line:
            return line.split("] ", 1)[-1][:110]
    return ""


def _expires(run: Run, producer: Server, before: dict[str, float], what: str) -> bool:
    """Within the lease and a margin, the offer expires and its export pages are free again."""
    def gone():
        now = producer.metrics(producer.admin)
        return metric(now, EXPIRED) - metric(before, EXPIRED) == 1 and metric(now, LEASED) == 0
    return run.expect(wait_for(gone, LEASE_S + 10, 0.5), f"{what}: lease did not expire to 0 pages")


def never_pulled(run: Run, producer: Server, text: str) -> None:
    before = producer.metrics(producer.admin)
    _, ktp, _ = prefill(producer, text)
    held = metric(producer.metrics(producer.admin), LEASED)
    ok = run.expect(ktp is not None and held > 0, f"never-pulled: no lease ({held} pages, {ktp})")
    ok &= _expires(run, producer, before, "never-pulled")
    ok &= run.expect("expired unpulled" in producer.log_text(), "never-pulled: no expiry log line")
    run.cases.append(("decode never pulls", ok, f"{held:.0f} pages leased, expired after "
                      f"KV_LEASE_S={LEASE_S:g}, 0 leased after"))


def restarted(run: Run, first: Server, decode: Server, text: str, cold: dict, model_dir: Path,
              servers: list[Server]) -> Server:
    _, ktp, rid = prefill(first, text)
    first.down()
    second = ours(run.args, model_dir, "ours-2", str(model_dir))
    servers.append(second)
    second.up()
    log0 = len(decode.log_text())
    verdict, step, _ = prompts.compare(cold, decode_with(decode, text, ktp, rid)["choices"][0])
    said = _said(decode, log0, "NIXL transfer failure") or _said(decode, log0, "ERROR")
    ok = run.expect(verdict != "FAIL", f"restart: continuation {verdict} at step {step}")
    ok &= run.expect(bool(said), "restart: the decode logged no failed pull")
    run.cases.append(("producer restarted before the pull", ok,
                      f"decode recomputed, continuation {verdict} to cold; decode: {said}"))
    return second


def hash_mismatch(run: Run, prev: Server, decode: Server, text: str, cold: dict,
                  model_dir: Path, servers: list[Server]) -> None:
    prev.down()
    bad = ours(run.args, model_dir, "ours-3", f"{model_dir}-not-the-decodes")
    servers.append(bad)
    bad.up()
    before = bad.metrics(bad.admin)
    log0 = len(decode.log_text())
    _, ktp, rid = prefill(bad, text)
    verdict, step, _ = prompts.compare(cold, decode_with(decode, text, ktp, rid)["choices"][0])
    said = _said(decode, log0, "compatibility hash mismatch")
    ok = run.expect(verdict != "FAIL", f"hash mismatch: continuation {verdict} at step {step}")
    ok &= run.expect(bool(said), "hash mismatch: the decode did not log it")
    ok &= _expires(run, bad, before, "hash mismatch")
    ok &= run.expect("expired unpulled" in bad.log_text(), "hash mismatch: no expiry log line")
    run.cases.append(("compatibility hash mismatch", ok,
                      f"decode recomputed, continuation {verdict} to cold; decode: {said}; "
                      "ours: the lease expired unpulled"))


def run_all(run: Run, first: Server, decode: Server, texts, cold, model_dir: Path,
            servers: list[Server]) -> None:
    never_pulled(run, first, texts[1])
    second = restarted(run, first, decode, texts[2], cold[2], model_dir, servers)
    hash_mismatch(run, second, decode, texts[3], cold[3], model_dir, servers)
