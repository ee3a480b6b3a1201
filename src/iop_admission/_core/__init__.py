"""The sans-I/O admission core: :class:`~iop_admission.core.AdmissionState` and what it is made of.

No trio, no clock, no I/O: time is passed in and every change returns decisions
that a layer (``iop_admission._layers``) carries out.
"""
