"""The scaling-law framework (DESIGN 5): the paper's residual law, the dense law per
context, the ln-ratio delta forms (its rivals), held-out validation, recommenders.

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
  :mod:`~xmodlm.bench.law_fit`, times a fit on them);
* :mod:`~xmodlm.law.select`: which runs a law is fitted on (one learning rate, one
  variant, the paired baseline).

The paper's law (Eq. 14 on the additive residual, the primary law; docs/law.md):

* :mod:`~xmodlm.law.paper`: the form, its terms, K_hat, Table 8 and ``PaperLaw``;
* :mod:`~xmodlm.law.backbone`: the paper's backbones and the counts of a (K, A, N0)
  model built on one;
* :mod:`~xmodlm.law.reference`: the dense reference at the same FLOPs, from dense
  curves (the fitted dense law as fallback), and the frame the fit reads;
* :mod:`~xmodlm.law.paper_fit`: the two-stage fit, bootstrap, grouped held-out tests;
* :mod:`~xmodlm.law.paper_recommend`: ``recommend_paper`` over (K, A, N0);
* :mod:`~xmodlm.law.paper_synthetic`: sweeps drawn from Eq. 14.

Nothing is imported here, so ``xmod law fit`` does not pay for torch.
"""
