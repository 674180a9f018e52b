"""hpsjax experiments: every scheme from a config, compared on equal terms.

* ``python -m experiments.run --config=experiments/configs/<scheme>.py[:setting]
  --workdir=DIR`` trains one scheme (:func:`experiments.train.train_and_evaluate`);
* ``python -m experiments.compare --suite=NAME --workdir=DIR`` runs a suite of
  schemes and writes the time-to-accuracy table and plot
  (:func:`experiments.compare.run_suite`);
* ``python -m experiments.advise --profiles 'profile_*.json'`` ranks every scheme
  on a simulated twin of the cluster the profiles describe
  (:func:`experiments.advise.advise`);
* ``python -m experiments.frontier --workdir=DIR`` tests each recent method's
  claim against its baseline (:func:`experiments.frontier.run_frontier`).

Schemes, settings and suites live in ``experiments/configs/``; the registries of
names in configs in :mod:`experiments.registry`; the two backends (simulator,
real processes) in :mod:`experiments.backends`. See ``RESULTS.md`` for measured
results and the commands that produced them.
"""
