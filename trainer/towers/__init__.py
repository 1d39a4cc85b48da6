"""Disaggregated multi-tower (DMT) training: tower plans and the partitioner, tower modules,
the towered DLRM and the SPTT schedule on ``torch.distributed`` subgroups (``docs/towers.md``).
"""
