"""Token-budget scheduler: decode first, then prefill chunks, with preemption."""
