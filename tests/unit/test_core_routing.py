"""The engine core's outputs with several API processes (mili serve --api-server-count): each request's
deltas and errors go to the process that added it, the gauges to all, Ready and Dead to all and to the
supervisor; with one process every step message goes to it whole."""

from __future__ import annotations

from types import SimpleNamespace

from mili.engine.core_process import Outputs
from mili.engine.messages import AddRequest, Dead, SeqDelta, Stats, StepMessage, encode, output_decoder
from mili.sampling_params import SamplingParams


class _Socket:
    def __init__(self):
        self.sent = []

    def send(self, data, flags=0):
        self.sent.append(output_decoder.decode(data))


def _add(request_id: str, client: int) -> AddRequest:
    return AddRequest(request_id, [1, 2], SamplingParams(max_tokens=4), 8, 0.0, client=client)


def _delta(request_id: str) -> SeqDelta:
    return SeqDelta(request_id, 0, [7])


STATS = Stats(1, 0, 10, 9, 0, 3)


def test_each_request_goes_to_its_process_and_the_stats_to_all():
    sockets, control = [_Socket(), _Socket()], _Socket()
    out = Outputs(sockets, control)
    core = SimpleNamespace(requests={"a": 1, "b": 1, "c": 1})
    for rid, client in (("a", 0), ("b", 1), ("c", 1)):
        out.add(_add(rid, client))
    out.send_step(StepMessage([_delta("a"), _delta("b"), _delta("c")], 2, None, [], [("c", "boom")]), core)
    (zero,), (one,) = sockets[0].sent, sockets[1].sent
    assert [d.request_id for d in zero.deltas] == ["a"] and zero.failures == [] and zero.num_preemptions == 2
    assert [d.request_id for d in one.deltas] == ["b", "c"] and one.failures == [("c", "boom")]
    # a step with only process 1's tokens and no gauges: nothing to process 0
    out.send_step(StepMessage([_delta("b")], 2), core)
    assert len(sockets[0].sent) == 1 and len(sockets[1].sent) == 2
    # the gauges go to both, with or without tokens of theirs
    out.send_step(StepMessage([_delta("b")], 2, STATS), core)
    assert sockets[0].sent[-1].stats == STATS and sockets[0].sent[-1].deltas == []
    assert sockets[1].sent[-1].stats == STATS and len(sockets[1].sent[-1].deltas) == 1
    assert control.sent == []  # the supervisor hears Ready and Dead only
    out.send_all(Dead("gone"))
    assert all(isinstance(s.sent[-1], Dead) for s in (*sockets, control))


def test_owners_are_forgotten_when_requests_leave_the_core():
    out = Outputs([_Socket(), _Socket()])
    core = SimpleNamespace(requests={"a": 1, "b": 1})
    out.add(_add("a", 0))
    out.add(_add("b", 1))
    del core.requests["a"]  # finished in this step
    out.send_step(StepMessage([_delta("a"), _delta("b")], 0), core)
    assert out.owner == {"b": 1}
    del core.requests["b"]  # aborted by its process
    out.forget(core, ["b"])
    assert out.owner == {}


def test_one_process_gets_every_message_whole():
    sock = _Socket()
    out = Outputs([sock])
    out.add(_add("a", 0))
    msg = StepMessage([_delta("a"), _delta("unknown")], 1, STATS, [("x", "bad")])
    out.send_step(msg, SimpleNamespace(requests={}))
    assert sock.sent == [output_decoder.decode(encode(msg))] and out.owner == {}


def test_a_process_that_is_gone_loses_its_requests_and_hears_nothing_more():
    sockets = [_Socket(), _Socket()]
    out = Outputs(sockets, _Socket())
    aborted = []
    core = SimpleNamespace(requests={"a": 1, "b": 1})
    core.abort_requests = lambda ids: (aborted.extend(ids), [core.requests.pop(r) for r in ids])
    out.add(_add("a", 0))
    out.add(_add("b", 1))
    out.client_gone(core, 0)
    assert aborted == ["a"] and out.owner == {"b": 1}
    out.send_step(StepMessage([_delta("b")], 0, STATS), core)
    out.send_all(Dead("gone"))
    assert sockets[0].sent == [] and len(sockets[1].sent) == 2
