"""A trio job runner that shares two GPUs among model aliases.

Run it: ``python examples/trio_job_runner.py``. It needs only the base install
(``pip install iop-admission``). Ten jobs ask for two model aliases; each alias
may run on either GPU (preferring its own), each GPU runs at most two jobs at a
time, and a job that waits more than 5 s in the queue gives up.
"""

from __future__ import annotations

import trio

from iop_admission import (
    Admission,
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
    QueueTimeout,
)

GPU0 = ProviderKey("local", "gpu0")
GPU1 = ProviderKey("local", "gpu1")


def build_pool() -> PoolConfig:
    """Two GPUs, two aliases, a bounded queue."""
    return PoolConfig(
        policy=QueuePolicy(max_queue=32, queue_timeout=5.0),
        providers={GPU0: ProviderSpec(capacity=2), GPU1: ProviderSpec(capacity=2)},
        models={
            "chat": ModelGroup([GPU0, GPU1]),
            "embed": ModelGroup([GPU1, GPU0]),
        },
    )


async def run_job(admission: Admission, job: int, model: str, done: list[tuple[int, str]]) -> None:
    """Hold a lease on one GPU while the job runs; the scope's exit releases it."""
    try:
        async with admission.lease(model) as lease:
            await trio.sleep(0.1)  # the job's work, on lease.provider
            done.append((job, str(lease.provider)))
    except QueueTimeout:
        done.append((job, "gave up"))


async def run_jobs(jobs: int = 10) -> list[tuple[int, str]]:
    """Run ``jobs`` jobs, alternating the two aliases; return (job, GPU) in completion order."""
    admission = Admission(build_pool())
    admission.connect("local")  # the node "local" hosts both GPUs: nothing is eligible before this
    done: list[tuple[int, str]] = []
    async with trio.open_nursery() as nursery:
        for job in range(jobs):
            nursery.start_soon(run_job, admission, job, "chat" if job % 2 == 0 else "embed", done)
    assert admission.queue_depth == 0
    return done


def main() -> None:
    for job, where in trio.run(run_jobs):
        print(f"job {job} ran on {where}")


if __name__ == "__main__":
    main()
