"""Framework integrations: each module plugs runbus into one framework and logs from every rank.

- runbus.integrations.lightning: RunbusLogger, a PyTorch Lightning Logger, and RunbusStepTimer,
  the callback it adds for per-rank step timing.
- runbus.integrations.transformers: RunbusCallback, a Hugging Face Trainer callback.
- runbus.integrations.accelerate: RunbusTracker, a Hugging Face Accelerate tracker, and
  log_every_process() / finish_every_process() for what accelerate runs on the main process only.

Each times every rank's steps with runbus.producer.clock.StepClock (data wait, compute, collective
wait: the perf/* figures), the clock run.watch(model) uses under plain DistributedDataParallel.

Each module imports its framework when imported itself; this package imports none.
"""
