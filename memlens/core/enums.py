"""The names every verb shares: memory categories, step phases and the labels of non-module code.

Both are ``str`` enums, so a member *is* its string (``Category.GRADIENTS == "gradients"``) and
JSON output keeps the plain names. estimate and profile use the same members, so an estimate
and a measurement line up field by field.

>>> Category("gradients") is Category.GRADIENTS, Phase.BACKWARD == "backward"
(True, True)
>>> [c.value for c in Category][:3]
['parameters', 'buffers', 'gradients']
"""
from __future__ import annotations

from enum import Enum


class Category(str, Enum):
    """What a live storage is (PyTorch's own words where it has them)."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"                  # saved for backward
    TEMPORARIES = "temporaries"                  # everything else allocated by the step
    INPUTS = "inputs"                            # the batch
    PER_SAMPLE_GRADIENTS = "per_sample_gradients"  # DP-SGD (Opacus grad_sample, and the per-sample norms)
    GRAM_MATRICES = "gram_matrices"              # DP-SGD ghost clipping: Opacus' norm samplers (B x T x T per Linear)
    WORKSPACE = "workspace"                      # library workspaces (cuBLAS) through the allocator
    COMMUNICATION = "communication"              # collective buffers in the caching allocator (DDP buckets, FSDP all-gather)

    def __str__(self) -> str:  # f-strings and str() give the plain name
        return self.value

    def __repr__(self) -> str:  # in a dict or list it reads as the string it equals
        return repr(self.value)


class Phase(str, Enum):
    """Where in the training loop an event happened."""

    SETUP = "setup"            # model, batch and optimizer creation
    START = "start"            # profiler started
    FORWARD = "forward"
    BACKWARD = "backward"
    CLIP = "clip"              # DP-SGD: Opacus' DPOptimizer clips, accumulates, adds noise (before the update)
    OPTIMIZER = "optimizer"
    END = "end"                # step finished (after zero_grad)
    BETWEEN_STEPS = "between steps"
    DONE = "done"              # simulation over: what follows is teardown
    STOP = "stop"              # profiler stopped
    MARK = "mark"              # a user's labelled snapshot

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


CATEGORIES: tuple[str, ...] = tuple(c.value for c in Category)
STEP_PHASES: tuple[str, ...] = (Phase.FORWARD.value, Phase.BACKWARD.value, Phase.OPTIMIZER.value)
# the phases a profile measures (clip: DP-SGD, Opacus' DPOptimizer before the update)
MEASURED_PHASES: tuple[str, ...] = (Phase.FORWARD.value, Phase.BACKWARD.value, Phase.CLIP.value, Phase.OPTIMIZER.value)

# Module labels for code that runs outside any nn.Module (the same in estimate and profile)
ROOT_LABEL = "(model: loss and glue)"   # the root module: the loss and code between blocks
OUTSIDE_LABEL = "(outside modules)"     # forward-time code outside the model (the loss function)
OPTIMIZER_LABEL = "(optimizer)"         # the optimizer step
INPUTS_LABEL = "(inputs)"               # the batch
