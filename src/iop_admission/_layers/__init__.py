"""The layers that carry out the core's decisions: trio (``Admission``) and asyncio (``AsyncAdmission``).

They park, wake, time out and cancel; they never decide (``iop_admission._core`` does).
"""
