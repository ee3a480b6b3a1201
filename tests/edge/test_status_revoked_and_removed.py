"""``/status`` and ``iop status`` while a provider a reload removed still runs a revoked lease:
the row stays, marked removed, and the summary counts the body still running
([removed-provider-visible] [revoked-in-flight])."""

from __future__ import annotations

import json

import attrs
import pytest
import trio
from tests.edge.test_status_cli import GPU1, recording_console, serving, status_document, two_node_admission

from iop_admission import LeaseRevoked, ModelGroup
from iop_edge.status import parse_status
from iop_edge.status_cli import main


@pytest.mark.req("removed-provider-visible", "revoked-in-flight")
def test_a_removed_provider_running_a_revoked_lease_stays_in_status_and_the_summary() -> None:
    admission = two_node_admission()
    documents: list[dict[str, object]] = []

    async def scenario() -> None:
        admission.connect("node-a")
        with pytest.raises(LeaseRevoked):
            async with admission.lease("ornith-fast"):
                config = admission.config
                admission.refresh(
                    attrs.evolve(
                        config,
                        providers={GPU1: config.providers[GPU1]},
                        models={"ornith:35b": ModelGroup(candidates=(GPU1,))},
                    )
                )
                admission.connect("node-a")  # a reconnect fences the lease: its body is still here
                documents.append(json.loads(json.dumps(status_document(admission))))
        documents.append(status_document(admission))

    trio.run(scenario)
    during, after = documents
    rows = {(p["node_id"], p["provider_id"]): p for p in during["providers"]}  # type: ignore[index]
    removed = rows[("node-a", "gpu0")]
    assert (removed["status"], removed["in_flight"], removed["revoked_in_flight"]) == ("removed", 0, 1)
    assert parse_status(during).snapshot.provider("node-a", "gpu0").revoked_in_flight == 1
    transport, _ = serving(during)
    console = recording_console()
    assert main(["status"], transport=transport, console=console) == 0
    summary = " ".join(console.export_text().split())  # the line as read, whatever the wrapping
    assert summary.startswith(
        "providers 2 (0 available, 1 unavailable, 0 disabled, 1 removed), "
        "in flight 0/0 (+1 revoked, still running); nodes 1/2 connected"
    )
    assert [p["provider_id"] for p in after["providers"]] == ["gpu1"]  # type: ignore[index]
