"""The apply arithmetic: how a parameter server turns accepted pushes into parameters.

The server's decisions (:mod:`hpsjax.decisions`) never touch an array; they hand the
arithmetic to an :class:`Aggregator` beside them, which holds the parameters, the
optimizer state and the update buffer, compiles the steps and checks finiteness. Its
two variants live here too: :class:`OverlapAggregator` applies a push leaf by leaf as
it arrives (the asyncio server's, built on :class:`LeafApply`), and
:class:`DeferredAggregator` keeps the updates of new versions and carries them out
in one compiled call when the parameters are next read (the simulator's, which may
push a :class:`LazyUpdate`). Every variant gives the same values as applying each
version at once.
"""

from hpsjax.apply._aggregate import (
    Aggregator,
    Pending,
)
from hpsjax.apply._deferred import (
    DeferredAggregator,
    LazyUpdate,
)
from hpsjax.apply._overlap import (
    OverlapAggregator,
)
from hpsjax.apply._separable import (
    LeafApply,
    LeafSteps,
    all_finite,
    finite,
    leaf_steps,
)

__all__ = [
    "Aggregator",
    "DeferredAggregator",
    "LazyUpdate",
    "LeafApply",
    "LeafSteps",
    "OverlapAggregator",
    "Pending",
    "all_finite",
    "finite",
    "leaf_steps",
]
