"""KV handoff to a vLLM decode over NIXL: wire format, side channel, export region, agent."""
