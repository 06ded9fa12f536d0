#!/usr/bin/env python
"""Soak a running `met serve` on loopback with a bounded mixed load.

    python scripts/soak.py --url http://127.0.0.1:8888 --minutes 3 --concurrency 8

Workers send, until the time is up: valid requests (chat and completions, streamed or
not), invalid ones (each must get a 4xx with an OpenAI-shaped error), streams cancelled
after a few events, and long generations. At the end it waits for the server to go idle
and reports requests by kind and outcome, the KV blocks still held (leaks), and the
resident memory of the server process over time (from /proc; the pid is found from the
listening port, or give --pid). Exit status 1 when anything went wrong: a 5xx, an error
event, a hang, an unexpected status, or a leaked block.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

KINDS = {"valid": 6, "invalid": 2, "cancelled": 2, "long": 1}  # relative weights
INVALID_BODIES = [
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "temperature": 9}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]}),
    ("/v1/completions", {"prompt": [10**9]}),
    ("/v1/completions", {"prompt": "hi", "n": "many"}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**7}),
    ("/v1/completions", [1, 2, 3]),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}),
]
WORDS = ("the keeper lit the lamp at dusk and wrote the weather in a small book while the "
         "sea rose against the rocks below").split()


@dataclass
class Report:
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome) -> count
    problems: list[str] = field(default_factory=list)
    memory: list[tuple[float, int, float, float]] = field(default_factory=list)

    def add(self, kind: str, outcome: str, problem: str | None = None) -> None:
        self.outcomes[(kind, outcome)] += 1
        if problem is not None and len(self.problems) < 50:
            self.problems.append(f"{kind}/{outcome}: {problem}")


def _prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _body(kind: str, rng: random.Random, model: str) -> tuple[str, dict]:
    max_tokens = rng.randint(64, 256) if kind == "long" else rng.randint(1, 24)
    common = {"model": model, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8]),
              "stream": kind == "cancelled" or rng.random() < 0.5}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**common, "messages": [
            {"role": "user", "content": _prompt(rng, rng.randint(2, 40))}]}
    return "/v1/completions", {**common, "prompt": _prompt(rng, rng.randint(2, 60)),
                               "n": rng.choice([1, 1, 2])}


async def _generate(client: httpx.AsyncClient, kind: str, path: str, body: dict,
                    rng: random.Random, report: Report) -> None:
    if not body["stream"]:
        r = await client.post(path, json=body)
        if r.status_code == 200:
            choices = r.json()["choices"]
            report.add(kind, "ok" if choices else "bad-body", None if choices else r.text[:200])
        else:
            _status(kind, r.status_code, r.text, report)
        return
    stop_after = rng.randint(1, 6) if kind == "cancelled" else None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            _status(kind, r.status_code, (await r.aread()).decode(errors="replace"), report)
            return
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                report.add(kind, "ok")
                return
            if '"error"' in line and "error" in json.loads(line[6:]):
                report.add(kind, "error-event", line[:200])
                return
            events += 1
            if stop_after is not None and events >= stop_after:
                report.add(kind, "cancelled")
                return  # leaving the block closes the connection mid-stream
        report.add(kind, "no-done", "the stream ended without [DONE]")


def _status(kind: str, status: int, text: str, report: Report) -> None:
    if status in (429, 503):
        report.add(kind, f"busy-{status}")  # load shedding, as configured
    elif status >= 500:
        report.add(kind, f"http-{status}", text[:200])
    else:
        report.add(kind, f"http-{status}", f"a valid request got {status}: {text[:200]}")


async def _invalid(client: httpx.AsyncClient, rng: random.Random, report: Report) -> None:
    path, body = rng.choice(INVALID_BODIES)
    r = await client.post(path, json=body)
    try:
        err = r.json()["error"]
        shaped = set(err) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        shaped = False
    if 400 <= r.status_code < 500 and shaped:
        report.add("invalid", "4xx")
    else:
        report.add("invalid", f"http-{r.status_code}", f"{path} {body}: {r.text[:200]}")


async def _worker(client: httpx.AsyncClient, deadline: float, seed: int, model: str,
                  timeout: float, report: Report) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items(), strict=True)
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        try:
            async with asyncio.timeout(timeout):
                if kind == "invalid":
                    await _invalid(client, rng, report)
                else:
                    path, body = _body(kind, rng, model)
                    await _generate(client, kind, path, body, rng, report)
        except TimeoutError:
            report.add(kind, "hang", f"no answer within {timeout:g} s")
        except httpx.HTTPError as e:
            report.add(kind, "transport-error", repr(e))


def _metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            name = key.partition("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def _rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def find_listener_pid(port: int) -> int | None:
    """The pid holding the listening TCP socket on ``port`` (Linux /proc), if visible."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # LISTEN
                inodes.add(cols[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid)
        except OSError:
            continue
    return None


async def _sampler(client: httpx.AsyncClient, pid: int | None, start: float, every: float,
                   stop: asyncio.Event, report: Report) -> None:
    while True:
        try:
            m = _metrics((await client.get("/metrics")).text)
            report.memory.append((time.monotonic() - start, int(m.get("met_requests_running", 0)),
                                  m.get("met_kv_blocks_used", float("nan")), _rss_mib(pid)))
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except TimeoutError:
            continue


async def soak(args: argparse.Namespace) -> tuple[Report, float]:
    report = Report()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=args.request_timeout) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        pid = args.pid or find_listener_pid(urlparse(args.url).port or 80)
        start = time.monotonic()
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sampler(client, pid, start, args.sample_every, stop,
                                               report))
        deadline = start + args.minutes * 60
        await asyncio.gather(*(_worker(client, deadline, args.seed + i, model,
                                       args.request_timeout, report)
                               for i in range(args.concurrency)))
        # Idle: nothing running or waiting; then whatever blocks are still held leaked.
        leaked = float("nan")
        for _ in range(300):
            m = _metrics((await client.get("/metrics")).text)
            leaked = m.get("met_kv_blocks_used", float("nan"))
            if m.get("met_requests_running", 0) == 0 and m.get("met_requests_waiting", 0) == 0 \
                    and leaked == 0:
                break
            await asyncio.sleep(0.1)
        stop.set()
        await sampler
        health = (await client.get("/health")).json().get("status")
        if health != "ok":
            report.problems.append(f"/health says {health!r} after the load")
        report.memory.append((time.monotonic() - start, 0, leaked, _rss_mib(pid)))
        if pid is None:
            report.problems.append("server pid not found: no memory samples (use --pid)")
    return report, leaked


def print_report(report: Report, leaked: float, minutes: float) -> bool:
    """Print the tables; True when the run was clean."""
    total = sum(report.outcomes.values())
    print(f"\n{total} requests in {minutes:g} min")
    print(f"{'kind':<10} {'outcome':<16} {'count':>7}")
    for (kind, outcome), n in sorted(report.outcomes.items()):
        print(f"{kind:<10} {outcome:<16} {n:>7}")
    print(f"\nleaked KV blocks after the load: {leaked:g}")
    print(f"\n{'t (s)':>7} {'running':>8} {'kv used':>8} {'RSS (MiB)':>10}")
    for t, running, used, rss in report.memory:
        print(f"{t:>7.0f} {running:>8} {used:>8g} {rss:>10.1f}")
    bad = {"ok", "4xx", "cancelled", "busy-429", "busy-503"}
    failures = {k: n for k, n in report.outcomes.items() if k[1] not in bad}
    for problem in report.problems:
        print("problem:", problem)
    clean = not failures and leaked == 0 and not any(
        p.startswith("/health") for p in report.problems)
    print("\nresult:", "clean" if clean else f"FAILED {failures or ''}")
    return clean


def run_schemathesis(args: argparse.Namespace) -> int:
    """schemathesis over the server's /openapi.json (every phase, positive and negative
    cases), failing only on 5xx; its exit status (0: no server error found)."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", args.url + "/openapi.json",
           "--max-examples", str(args.fuzz_examples), "--checks", "not_a_server_error",
           "--request-timeout", str(args.request_timeout), "--max-time",
           str(int(args.fuzz_minutes * 60))]
    print("\nschemathesis:", " ".join(cmd[1:]))  # before the key joins the command
    if args.api_key:
        cmd += ["--header", f"Authorization: Bearer {args.api_key}"]
    return subprocess.run(cmd, check=False).returncode


def _loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8888")
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--api-key", default=os.environ.get("MET_API_KEY"))
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--pid", type=int, default=None, help="server pid (default: the listener)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds before an unanswered request counts as a hang")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--fuzz-examples", type=int, default=0,
                   help="after the load, run schemathesis with this many cases per operation "
                        "(0: skip)")
    p.add_argument("--fuzz-minutes", type=float, default=5.0,
                   help="time budget of the schemathesis run")
    args = p.parse_args(argv)
    if not _loopback(args.url):
        p.error(f"--url: {args.url} is not a loopback address; the soak runs on this machine")
    if not 0 < args.minutes <= 24 * 60 or not 1 <= args.concurrency <= 1024:
        p.error("--minutes must be in (0, 1440] and --concurrency in [1, 1024]")
    report, leaked = asyncio.run(soak(args))
    clean = print_report(report, leaked, args.minutes)
    if args.fuzz_examples > 0:
        fuzz_rc = run_schemathesis(args)
        print("schemathesis:", "no server error" if fuzz_rc == 0 else f"FAILED ({fuzz_rc})")
        clean = clean and fuzz_rc == 0
    if args.json is not None:
        args.json.write_text(json.dumps({
            "minutes": args.minutes, "concurrency": args.concurrency, "clean": clean,
            "outcomes": {f"{k}/{o}": n for (k, o), n in sorted(report.outcomes.items())},
            "leaked_blocks": leaked, "problems": report.problems,
            "memory": [{"t": t, "running": r, "kv_used": u, "rss_mib": m}
                       for t, r, u, m in report.memory]}, indent=1))
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
