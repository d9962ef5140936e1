"""Workloads with sessions for the twin's virtual clock: multi-turn chats and tool-using agents.

    script = generate(requests=4000, seed=0)       # deterministic from the seed
    workload = script.workload(scale=0.1)         # routing_sim.Workload, sessions start 10x as often
    reuse(script.natural_arrivals())              # sim.mooncake.Reuse: how much is seen before

Two kinds of session, mixed (`Mix.agent_share`):

- chat: an app's system prompt (one of `chat_apps`, shared by every chat of that app), then
  turns. Turn n's prompt is turn n-1's prompt + its answer + a new user message, so its blocks
  extend the previous turn's; between an answer and the next message the user thinks.
- agent: one of `agent_apps`, whose long system prompt and tool definitions (several thousand
  tokens) every session of that agent shares, then the session's task; each step's prompt adds
  the previous step's tool call (its answer) and the tool's result, after the tool's latency.

Prompts are token streams cut into `block_tokens`-token blocks with ids as a content hash would
give them: a block wholly inside an app's shared prefix has the app's id (equal across
sessions), any other full block the session's (equal across its turns, as the stream only
grows), and a partial last block an id of its own (its content changes with the next turn).
The twin caches only full pages and never its generated tokens, so a next turn hits at most the
previous prompt's full blocks; its previous answer is prefilled again, as on the twin over HTTP.

Time: the script is written in natural time (session starts Poisson, each turn its predecessor's
arrival + think time, as if answers took no time). `workload(scale)` sets the load by the rate
of session starts (their times x `scale`: more sessions at once), not by compressing the
sessions: a next turn is sent once its predecessor has finished, after its think time (natural
seconds). A conversation cannot go faster than its answers come, so compressing think times
would not raise the rate once they are shorter than an answer; more concurrent sessions do.
In steady state the request rate is the session rate x the mean turns per session; it ramps up
over about one session's duration and down after the last start (`Script.steady`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

from bench.routing_sim import Workload
from sim.lengths import parse_output_lengths
from sim.virtual import Arrival, RequestRecord

MAX_PROMPT = 30_000
"""A session ends before its prompt would pass this (the twin's context is 32,768 tokens)."""


@dataclass(frozen=True)
class Mix:
    """The generator's knobs (token counts, seconds of natural time)."""

    agent_share: float = 0.4
    """Share of sessions that are agents (the rest chats)."""
    session_rate: float = 0.5
    """Session starts per second (Poisson)."""
    block_tokens: int = 64
    chat_apps: int = 8
    chat_system: tuple[int, int] = (200, 1600)
    """An app's system prompt: uniform in this range, drawn once per app."""
    chat_first: float = 300.0
    """Median first user message (lognormal, sigma 1)."""
    chat_next: float = 120.0
    """Median later user message (lognormal, sigma 1)."""
    chat_turns: float = 5.0
    """Mean turns of a chat (1 + geometric)."""
    chat_think: float = 8.0
    """Median think time between an answer and the next message (lognormal, sigma 0.8)."""
    agent_apps: int = 4
    agent_system: tuple[int, int] = (3000, 9000)
    """An agent's system prompt and tool definitions, drawn once per agent."""
    agent_task: float = 150.0
    agent_steps: float = 8.0
    agent_call: float = 80.0
    """Median tool call (the step's output; lognormal, sigma 0.6)."""
    agent_result: float = 400.0
    """Median tool result appended to the next step's prompt (lognormal, sigma 1)."""
    agent_think: float = 1.0
    """Median tool latency between a step's answer and the next step (lognormal, sigma 0.8)."""


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    prefix: tuple[Hashable, ...]
    output_tokens: int
    think_s: float
    """Natural seconds between this turn's answer and the next turn (0 after the last)."""


@dataclass(frozen=True)
class Session:
    kind: str
    """chat | agent"""
    app: int
    start: float
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Script:
    sessions: tuple[Session, ...]
    block_tokens: int

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def natural_times(self) -> Iterator[tuple[float, Session, int]]:
        """(natural arrival time, session, turn index) of every turn, unsorted."""
        for s in self.sessions:
            t = s.start
            for n, turn in enumerate(s.turns):
                yield t, s, n
                t += turn.think_s

    def natural_arrivals(self) -> list[Arrival]:
        """Every turn as an open arrival at its natural time, in time order (for `reuse`)."""
        return [self.arrival(s, n, t) for t, s, n in sorted(self.natural_times(), key=lambda x: x[0])]

    def natural_span(self) -> float:
        return max(t for t, _, _ in self.natural_times())

    def arrival(self, session: Session, n: int, time: float) -> Arrival:
        turn = session.turns[n]
        return Arrival(
            time=time,
            prompt_tokens=turn.prompt_tokens,
            output_tokens=turn.output_tokens,
            prefix=turn.prefix,
            prefix_block_tokens=self.block_tokens,
        )

    def mean_turns(self) -> float:
        return self.requests / len(self.sessions) if self.sessions else 0.0

    def session_rate(self) -> float:
        """Natural session starts per second."""
        return len(self.sessions) / max(self.sessions[-1].start, 1e-9) if self.sessions else 0.0

    def mean_duration(self) -> float:
        """Natural seconds from a session's first turn to its last (think times only)."""
        return sum(sum(t.think_s for t in s.turns) for s in self.sessions) / max(len(self.sessions), 1)

    def steady(self, scale: float) -> tuple[float, float]:
        """The window where the request rate is steady at `scale`: from 1.5 mean session
        durations after the first start (the ramp; answers take time too) to the last start."""
        return self.sessions[0].start * scale + 1.5 * self.mean_duration(), self.sessions[-1].start * scale

    def workload(self, scale: float) -> Workload:
        """Sessions starting at `scale` x their natural times, each next turn its think time after
        its predecessor finished; the warm-up is the ramp (`steady`)."""
        return SessionRun(self, scale).workload(self.steady(scale)[0])


@dataclass
class SessionRun:
    """The follow-up bookkeeping of one run: which arrival index is which session's turn.

    simulate() numbers follow-ups after the first turns in the order they are returned, and
    routing_sim.run asks for at most one per finished request, so a counter tracks them."""

    script: Script
    scale: float
    _turn_of: dict[int, tuple[int, int]] = field(default_factory=dict)
    _next: int = 0

    def workload(self, warmup_s: float) -> Workload:
        sessions = self.script.sessions
        order = sorted(range(len(sessions)), key=lambda i: sessions[i].start)
        arrivals = []
        for index, i in enumerate(order):
            self._turn_of[index] = (i, 0)
            arrivals.append(self.script.arrival(sessions[i], 0, sessions[i].start * self.scale))
        self._next = len(arrivals)
        return Workload(arrivals, warmup_s=warmup_s, follow_up=self.follow_up)

    def follow_up(self, record: RequestRecord) -> tuple[Arrival, ...]:
        i, n = self._turn_of.pop(record.index, (-1, -1))
        if i < 0:
            return ()
        session = self.script.sessions[i]
        if n + 1 >= len(session.turns):
            return ()
        self._turn_of[self._next] = (i, n + 1)
        self._next += 1
        time = record.finish_time + session.turns[n].think_s
        return (self.script.arrival(session, n + 1, time),)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int = 1, hi: int = 16_000) -> int:
    return min(max(round(median * math.exp(sigma * rng.gauss(0.0, 1.0))), lo), hi)


def _turns(rng: random.Random, mean: float) -> int:
    """1 + geometric with the given mean in all."""
    if mean <= 1:
        return 1
    p = 1.0 / mean
    n = 1
    while rng.random() > p and n < 64:
        n += 1
    return n


def _blocks(kind: str, app: int, sid: int, shared: int, tokens: int, turn: int, block: int) -> tuple[Hashable, ...]:
    full = tokens // block
    ids: list[Hashable] = [(kind, app, i) if (i + 1) * block <= shared else (sid, i) for i in range(full)]
    if tokens % block:
        ids.append((sid, full, "t", turn))
    return tuple(ids)


def generate(requests: int = 2000, seed: int = 0, mix: Mix = Mix()) -> Script:
    """Sessions until they hold at least `requests` turns in all; the same seed, the same script."""
    rng = random.Random(seed)
    answers = parse_output_lengths("azure-conv")
    b = mix.block_tokens
    chat_system = [rng.randint(*mix.chat_system) for _ in range(mix.chat_apps)]
    agent_system = [rng.randint(*mix.agent_system) for _ in range(mix.agent_apps)]
    sessions: list[Session] = []
    total, t = 0, 0.0
    while total < requests:
        t += rng.expovariate(mix.session_rate)
        sid = len(sessions)
        turns: list[Turn] = []
        if rng.random() < mix.agent_share:
            kind, app = "agent", rng.randrange(mix.agent_apps)
            shared = agent_system[app]
            prompt = shared + _lognormal(rng, mix.agent_task, 1.0)
            for n in range(_turns(rng, mix.agent_steps)):
                call = _lognormal(rng, mix.agent_call, 0.6, 10, 600)
                think = min(max(mix.agent_think * math.exp(0.8 * rng.gauss(0.0, 1.0)), 0.05), 60.0)
                turns.append(Turn(prompt, _blocks(kind, app, sid, shared, prompt, n, b), call, think))
                prompt += call + _lognormal(rng, mix.agent_result, 1.0, 20, 6000)
                if prompt > MAX_PROMPT:
                    break
        else:
            kind, app = "chat", rng.randrange(mix.chat_apps)
            shared = chat_system[app]
            prompt = shared + _lognormal(rng, mix.chat_first, 1.0)
            for n in range(_turns(rng, mix.chat_turns)):
                answer = answers.draw(rng)
                think = min(max(mix.chat_think * math.exp(0.8 * rng.gauss(0.0, 1.0)), 1.0), 600.0)
                turns.append(Turn(prompt, _blocks(kind, app, sid, shared, prompt, n, b), answer, think))
                prompt += answer + _lognormal(rng, mix.chat_next, 1.0)
                if prompt > MAX_PROMPT:
                    break
        last = turns[-1]
        turns[-1] = Turn(last.prompt_tokens, last.prefix, last.output_tokens, 0.0)
        sessions.append(Session(kind, app, t, tuple(turns)))
        total += len(turns)
    return Script(tuple(sessions), b)
