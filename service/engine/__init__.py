"""Engine: batch types, KV pool and pages, memory sizing, graph runner, scheduler."""
