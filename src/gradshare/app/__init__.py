"""What a person runs: ``gradshare train / bench / inspect``, the report, the demo's data.

What lives here: :mod:`~gradshare.app.cli` (the command), :mod:`~gradshare.app.train` (the
demo's training job, ``TrainConfig``), :mod:`~gradshare.app.report` (metrics.csv, summary,
report.png), :mod:`~gradshare.app.datasets` (scikit-learn's digits, the MLP).

May import anything of gradshare except :mod:`gradshare.integrations`; nothing imports it
(except the package's ``gradshare.cli`` entry point).
"""
