"""A toy parallelism, added through the parallelism registries alone: ``--sharding replicate2`` runs two ranks that
each hold a whole replica of the model and train their own micro-batch, with no communication at all (no DDP, no
buckets): each rank's memory is one GPU's. Nothing outside this file knows it."""
from memlens.core.parallel import Sharding, register_sharding
from memlens.step.parallel import Wrapper, register_wrapper

REPLICATE2 = register_sharding(Sharding("replicate2", "ddp", shards_optimizer_state=False, shards_gradients=False,
                                        shards_parameters=False, setting="toy: 2 independent replicas"))


class ReplicateWrapper(Wrapper):
    """The model as it is on each rank (every rank holds the same tensors: the default rank group)."""

    name = "replicate2"


register_wrapper(lambda plan: plan.sharding.name == "replicate2" and plan.world_size == 2, ReplicateWrapper)
