"""HALoS: hierarchical asynchronous local SGD, local servers per region.

The setting's workers form ``REGIONS`` regions of consecutive workers (sim8:
four regions of two). Each region has a local parameter server (LPS) that
its workers reach over a fast intra-region link (the setting's link
``INTRA_REGION_SPEEDUP`` times faster, its latency as many times shorter);
the LPSs reach the global parameter server (GPS) over the setting's own
link, the one every worker of ``diloco.py`` crosses. A worker takes local
Adam steps, the fastest ``plan.local_steps`` = 8 and each other in proportion
to its speed (plan scheme ``dylu``, fixed after the profiling pass, as the
reference rescales H by each worker's speed), and pushes the model
difference to its LPS, which applies it at once with Delayed Nesterov (local
momentum 0.9, N_l = 4 pushes per region worker); each time an LPS has made
K = 8 updates per region worker since its last merge it sends the
accumulated update to the GPS, which applies it with Delayed Nesterov
(global momentum 0.5, N_g = 2) and sends its model back; the LPS merges it
with weight alpha = 0.25 (``server.policy='halos'``,
``hpsjax.ps.POLICIES['halos']``; the simulator's ``hpsjax.sim.HalosCore``). The
run is timed on the GPS's model.

Read: the paper (arXiv 2506.04531: abstract, section 3 and Algorithm 1 as
the summaries give them: LPSs per region applying their workers' updates
asynchronously with local momentum, a GPS merging the LPSs' accumulated
updates asynchronously with global momentum) and the authors' code
(``utnslab/halos``: ``simulation/exec_halos.py``, ``ps.py``, ``opt.py``,
``examples/run_halos.sh``: K = 32 with 4 workers a region, alpha = 0.25,
LPS lr 0.2 x N_l, beta_l 0.9, N_l = 16; GPS lr 0.15 x N_g, beta_g 0.5,
N_g = 2; H = 8 rescaled by speed; AdamW inside). What differs: K and N_l
are scaled to the region's workers (the reference's 8 and 4 per worker of a
4-worker region); Adam without weight decay or schedule inside; every LPS
reaches the GPS over the slow link (the reference puts the GPS in region 0);
the simulator only (``hpsjax.sim``; a processes setting's workers are
simulated), no real processes.

Launch::

  python -m experiments.run --config=experiments/configs/halos.py:sim8 \\
      --workdir=/tmp/hpsjax/halos

References:
  Kim, Li, Gandham, Baldonado, Gangidi, Balaji, Wang, Akella, "HALoS:
  Hierarchical Asynchronous Local SGD over Slow Networks for Geo-Distributed
  Large Language Model Training", ICML 2025, https://arxiv.org/abs/2506.04531
"""

from experiments.configs import common

REGIONS = 4  # regions of consecutive workers, one LPS each
INTRA_REGION_SPEEDUP = 100.0  # the worker-LPS link against the setting's
K_PER_WORKER = 8  # the LPS's updates between two sends to the GPS, per worker
N_PER_WORKER = 4  # the LPS's Delayed Nesterov delay, per worker
LOCAL_LR = 0.2  # the reference's LPS step (plain step lr / N_l)
GLOBAL_LR = 0.15  # the reference's GPS step (plain step lr / N_g)
GLOBAL_DELAY = 2  # N_g


def get_config(arg=None):
    """HALoS for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "halos"
    # The simulator builds the two-level server (a processes setting's
    # workers are simulated too).
    config.backend = "sim"
    workers = config.workers
    regions = min(REGIONS, len(workers.slowdowns))
    per_region = max(1, len(workers.slowdowns) // regions)
    config.server.policy = "halos"
    config.server.policy_kwargs = {
        "regions": regions,
        "accumulation": K_PER_WORKER * per_region,
        "merge_weight": 0.25,
        "global_learning_rate": GLOBAL_LR * GLOBAL_DELAY,
        "global_momentum": 0.5,
        "global_delay": GLOBAL_DELAY,
        "global_bandwidth": workers.bandwidth,
        "global_latency": workers.latency,
    }
    if workers.bandwidth is not None:
        workers.bandwidth = workers.bandwidth * INTRA_REGION_SPEEDUP
    workers.latency = workers.latency / INTRA_REGION_SPEEDUP
    config.server.optimizer = "delayed_nesterov"
    config.server.outer_delay = N_PER_WORKER * per_region
    config.server.learning_rate = LOCAL_LR * config.server.outer_delay
    config.server.momentum = 0.9
    config.worker.local_optimizer = "adam"
    config.worker.local_learning_rate = common.pick(
        config, {"lm_sim8": 0.02, "default": 0.01}
    )
    config.plan.scheme = "dylu"
    config.plan.lr_scaling = "none"
    config.plan.local_steps = common.pick(config, {"default": 8})
    config.plan.max_local_steps = 64
    config.plan.replan = False
    return config
