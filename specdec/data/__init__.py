"""The data layer, below both training and evaluation: the offline datasets and the one held-out rule
(:mod:`~specdec.data.datasets`), the target and dataset settings (:mod:`~specdec.data.config`), token
sequences and their sources (:mod:`~specdec.data.sequences`, :mod:`~specdec.data.corpus`,
:mod:`~specdec.data.text`) and the target feature store (:mod:`~specdec.data.store`).

It imports neither :mod:`specdec.training` nor :mod:`specdec.eval`; both import it.
"""
