"""A toy step kind, added through the step-kind registry alone: every optimizer step runs the forward and
backward of its batch twice (the gradients add up), as a user's own training loop might."""
from memlens.step.kinds import StepKind, register_step_kind
from memlens.step.loop import train_step


def run_twice(step, on_phase):
    return train_step(step.model, step.optimizer, step.batch, grad_accum=2, autocast=step.autocast, scaler=step.scaler,
                      loss_fn=step.loss_fn, on_phase=on_phase, forward_keys=step.forward_keys, step_fn=step.step_fn)


TWICE = register_step_kind(StepKind("toy-twice", applies=lambda spec: False, run=run_twice, title="forward/backward twice"))
