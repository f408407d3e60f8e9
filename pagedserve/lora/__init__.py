"""LoRA adapters served beside the base model (issue 59).

Torch-free: `request.py` (what a request names), `config.py` (the engine's limits),
`peft_checkpoint.py` (a PEFT adapter folder checked against the model, by the HTTP server and
the engine core alike), `slots.py` (the LRU of device slots). With torch, in the worker:
`weights.py` (an adapter's tensors in our fused layout), `layer.py` (the per-row LoRA term
of a projection), `manager.py` (slots, host copies, each step's row -> slot map).
"""
