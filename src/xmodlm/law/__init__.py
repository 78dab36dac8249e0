"""The scaling-law framework (DESIGN 5): dense law per context, X-MoD delta law,
held-out validation, recommender.

Modules, each usable on its own:

* :mod:`~xmodlm.law.table`: read and validate results tables;
* :mod:`~xmodlm.law.dense`: the dense law L(N, D) and its careful fit;
* :mod:`~xmodlm.law.delta`: the registry of delta forms and their fit;
* :mod:`~xmodlm.law.holdout`: held-out protocols and metrics;
* :mod:`~xmodlm.law.fit`: ``fit_law`` (fitting, form selection, the bootstrap);
* :mod:`~xmodlm.law.lawfit`: ``LawFit``, a fitted law (JSON, ``load_fit``, its
  identification flags);
* :mod:`~xmodlm.law.predict`: ``predict``, ``predict_samples`` with a fitted law;
* :mod:`~xmodlm.law.recommend`: ``recommend`` (imports the model's FLOP accounting);
* :mod:`~xmodlm.law.synthetic`: tables from a known law (the law-fit benchmark,
  :mod:`~xmodlm.bench.law_fit`, times a fit on them).

Nothing is imported here, so ``xmod law fit`` does not pay for torch.
"""
