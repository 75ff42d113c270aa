"""MembershipRelay on its own: membership requests as one call each, with the records they relay
and tell, over a fake host standing for the shard facade (a lock of their own)."""

from __future__ import annotations

import threading

from ps_server.membership.ranks import WorkerState
from ps_server.shard.relay import MembershipRelay
from tests.unit.test_shard_members import Host, members_of


def test_a_resize_request_answers_the_count_and_epoch_in_force() -> None:
    host = Host()
    members = members_of(host)
    relay = MembershipRelay(host, members, threading.Condition())
    previous, at, count, epoch = relay.resize_request(3, None)
    assert (previous, at, count) == (2, 0, 3) and epoch == members.epochs.epoch > 0
    assert host.settings.num_workers == 3 and "advance" in host.calls


def test_a_heartbeat_tells_the_record_to_a_requester_that_knows_an_older_epoch() -> None:
    host = Host()
    members = members_of(host)
    relay = MembershipRelay(host, members, threading.Condition())
    members.join(0, 2, 1)
    version, state, epoch, record = relay.heartbeat_relaying(0, 1, None, request_epoch=0)
    assert (version, state, epoch) == (0, WorkerState.LIVE, members.epochs.epoch) and record is members.epochs.record
    assert relay.heartbeat_relaying(0, 1, None, request_epoch=epoch)[3] is None


def test_leaving_stops_counting_the_rank_on_shard_0() -> None:
    host = Host()
    members = members_of(host)
    relay = MembershipRelay(host, members, threading.Condition())
    session = members.join(1, 2, 1).session
    before = members.epochs.epoch
    version, epoch, _ = relay.leave_relaying(1, 1, session, None, 0)
    assert version == 0 and epoch > before and not members.membership.members[1].counted
    assert members.membership.members[1].state is WorkerState.LEFT
