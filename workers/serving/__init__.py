"""Serving: the engine and the fair-share logic put together.

`workers.engine` (the decoder: scheduler, KV cache, model) and `workers.fairness` (weights, the
VTC queue, the latency model: pure logic) do not import each other beyond the engine's boundary
types (`workers.engine.types`). This package composes them:

- `admission.py`: `EngineAdmission`, the scheduler's deadline-admission hook with a learning
  latency model, shared between the submitting thread and the engine thread;
- `fair_engine.py`: `FairEngine` (submit-time precheck, deadline watchdog thread, no OK after a
  deadline) and `build_fair_engine`, what the worker and the CLI use;
- `simulate.py`: the fair-share simulation, which drives the engine's real `Scheduler` and KV
  cache manager with a simulated clock and a step-cost model instead of a model.

Nothing is imported here, so `import workers.serving.simulate` does not load torch.
"""
