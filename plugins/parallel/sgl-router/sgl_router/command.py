"""``sgl router``: SGLang's router (the ``sglang-router`` package) in front of sgl workers.

The router is SGLang's own program, run as it is (``python -m sglang_router.launch_router``);
this command starts the ``sgl serve`` workers it fronts (``--workers N``, each on its share of
the cores, every argument after ``--`` passed to each) or takes running ones
(``--worker-urls``), waits until the router has registered them all, and stops everything it
started when the router exits or the command is interrupted.

With ``--pd-disaggregation`` the router runs in SGLang's PD mode in front of running prefill
and decode servers (``sgl serve --disaggregation-mode prefill|decode``): ``--prefill URL
[BOOTSTRAP_PORT]`` as SGLang's router takes it (the port, when left out, is read from the
prefill server), ``--decode URL``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import click
import httpx

from sgl.threads import take_core_share

__all__ = ["router"]

logger = logging.getLogger("sgl.router")

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


class _RouterCommand(click.Command):
    """Takes SGLang's ``--prefill URL [BOOTSTRAP_PORT]``: an optional second value, which click
    options cannot have, joined to the URL before click parses."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        joined: list[str] = []
        rest = list(args)
        while rest:
            arg = rest.pop(0)
            if arg == "--":
                joined += [arg, *rest]
                break
            if arg == "--prefill" and rest:
                value = rest.pop(0)
                if rest and (rest[0].isdigit() or rest[0] == "none"):
                    value = f"{value} {rest.pop(0)}"
                joined += [arg, value]
                continue
            joined.append(arg)
        return super().parse_args(ctx, joined)


@click.command(name="router", cls=_RouterCommand,
               context_settings={"ignore_unknown_options": True})
@click.argument("worker_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--worker-urls", multiple=True, metavar="URL",
              help="Running sgl (or SGLang) servers to route to (repeatable, or "
                   "comma-separated); default: start --workers of them.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="sgl serve workers to start on this machine, each on an equal share of the "
                   "cores, with the arguments after -- (default 2 without --worker-urls).")
@click.option("--pd-disaggregation", is_flag=True,
              help="SGLang's PD mode: each request goes to a --prefill and a --decode server "
                   "(sgl serve --disaggregation-mode prefill|decode), with the prefill "
                   "server's bootstrap address and a room added.")
@click.option("--prefill", "prefill", multiple=True, metavar="URL [BOOTSTRAP_PORT]",
              help="PD mode: a running prefill server (repeatable); its bootstrap port is "
                   "read from it when not given.")
@click.option("--decode", "decode", multiple=True, metavar="URL",
              help="PD mode: a running decode server (repeatable).")
@click.option("--policy", type=click.Choice(POLICIES), default="cache_aware", show_default=True,
              help="The router's policy: cache_aware (the worker whose cache likely holds the "
                   "prompt's prefix, else the least loaded), round_robin, power_of_two (the "
                   "less loaded of two, by each worker's /get_load) or random.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the router binds.")
@click.option("--port", type=click.IntRange(1, 65535), default=30000, show_default=True,
              help="Port of the router.")
@click.option("--dp-aware", is_flag=True,
              help="Route to each --dp-size replica of every worker (the router reads each "
                   "worker's dp_size and sends data_parallel_rank with every request).")
@click.option("--cache-threshold", type=click.FloatRange(0, 1), default=None,
              help="cache_aware: the share of a prompt a worker must hold to be chosen for it "
                   "(router default 0.3).")
@click.option("--balance-abs-threshold", type=click.IntRange(min=0), default=None,
              help="cache_aware: loads further apart than this go to the least loaded worker.")
@click.option("--balance-rel-threshold", type=click.FloatRange(min=1), default=None,
              help="cache_aware: ... and further apart than this ratio.")
@click.option("--prometheus-port", type=click.IntRange(1, 65535), default=29000,
              show_default=True, help="Port of the router's Prometheus metrics.")
@click.option("--prometheus-host", default=None,
              help="Address the router's Prometheus metrics bind (default: --host; SGLang's "
                   "router alone binds every interface).")
@click.option("--api-key", default=None, envvar="SGL_API_KEY", show_envvar=True,
              help="The workers' --api-key: the router sends it to them and requires it from its "
                   "own clients too (SGLang's router's --api-key). Default: the --api-key "
                   "among the worker arguments after --, if any.")
@click.option("--worker-startup-timeout", type=click.FloatRange(min=1), default=900.0,
              show_default=True, help="Seconds to wait for the workers to become healthy.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warn", "error"]),
              default="info", show_default=True, help="The router's log level.")
def router(worker_args: tuple[str, ...], worker_urls: tuple[str, ...], workers: int | None,
           pd_disaggregation: bool, prefill: tuple[str, ...], decode: tuple[str, ...],
           policy: str, host: str, port: int, dp_aware: bool, cache_threshold: float | None,
           balance_abs_threshold: int | None, balance_rel_threshold: float | None,
           prometheus_port: int, prometheus_host: str | None, api_key: str | None,
           worker_startup_timeout: float, log_level: str) -> None:
    """SGLang's router in front of sgl workers: ones it starts (`sgl router --workers 2 --
    --model-path ./model`) or running ones (`sgl router --worker-urls
    http://a:30000,http://b:30000`). Clients then talk to the router as to one sgl server."""
    from sgl.log import setup_logging

    setup_logging("info", process="router")
    if importlib.util.find_spec("sglang_router") is None:
        raise click.ClickException(
            "sgl router runs SGLang's router, which is not installed: pip install "
            "'sgl-router[router]' (or sglang-router; make install installs it)")
    worker_urls = tuple(u for value in worker_urls for u in value.split(",") if u)
    if pd_disaggregation or prefill or decode:
        _check_pd(pd_disaggregation, prefill, decode, worker_urls, workers, worker_args, dp_aware)
    strays = [a for a in worker_args if a.startswith(("http://", "https://"))]
    if strays:
        raise click.UsageError(f"{strays[0]}: --worker-urls takes one URL per flag "
                               "(--worker-urls A --worker-urls B) or a comma-separated list")
    if worker_urls and workers is not None:
        raise click.UsageError("give --worker-urls or --workers, not both")
    if worker_urls and worker_args:
        raise click.UsageError(f"arguments after -- ({' '.join(worker_args)}) are for workers "
                               "this command starts; --worker-urls names running ones")
    bad = [url for url in worker_urls if not url.startswith(("http://", "https://"))]
    if bad:
        raise click.UsageError(f"--worker-urls {bad[0]}: expected http://HOST:PORT")
    from sgl.server.launch import check_port

    problem = check_port(host, port)
    if problem:
        raise click.UsageError(problem)
    api_key = api_key or _worker_api_key(worker_args)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    shared = ["--prometheus-host", prometheus_host or host]
    if api_key:
        shared += ["--api-key", api_key]

    if pd_disaggregation:
        _wait_healthy([p.split()[0] for p in prefill] + list(decode), [], worker_startup_timeout)
        command = [sys.executable, "-m", "sglang_router.launch_router", "--host", host,
                   "--port", str(port), "--policy", policy, "--prometheus-port",
                   str(prometheus_port), "--log-level", log_level, "--pd-disaggregation",
                   *shared]
        for value in prefill:
            url, _, bootstrap = value.partition(" ")
            command += ["--prefill", url, bootstrap or str(_bootstrap_port(url, headers))]
        for url in decode:
            command += ["--decode", url]
        sys.exit(_run_router(command, f"http://{_client_host(host)}:{port}",
                             len(prefill) + len(decode), policy, headers))

    started: list[subprocess.Popen[bytes]] = []
    urls = list(worker_urls)
    try:
        if not urls:
            count = workers or 2
            for i in range(count):
                url, proc = _start_worker(i, count, worker_args)
                urls.append(url)
                started.append(proc)
        _wait_healthy(urls, started, worker_startup_timeout)
        expected = sum(_dp_size(url, headers) for url in urls) if dp_aware else len(urls)
        command = [sys.executable, "-m", "sglang_router.launch_router", "--host", host,
                   "--port", str(port), "--policy", policy, "--prometheus-port",
                   str(prometheus_port), "--log-level", log_level, *shared,
                   "--worker-urls", *urls]
        if dp_aware:
            command.append("--dp-aware")
        for flag, value in (("--cache-threshold", cache_threshold),
                            ("--balance-abs-threshold", balance_abs_threshold),
                            ("--balance-rel-threshold", balance_rel_threshold)):
            if value is not None:
                command += [flag, str(value)]
        sys.exit(_run_router(command, f"http://{_client_host(host)}:{port}", expected, policy,
                             headers))
    finally:
        _stop(started)


def _check_pd(pd_disaggregation: bool, prefill: tuple[str, ...], decode: tuple[str, ...],
              worker_urls: tuple[str, ...], workers: int | None, worker_args: tuple[str, ...],
              dp_aware: bool) -> None:
    if not pd_disaggregation:
        raise click.UsageError("--prefill and --decode are for PD mode: add --pd-disaggregation")
    if not prefill or not decode:
        raise click.UsageError("--pd-disaggregation needs at least one --prefill URL and one "
                               "--decode URL (running sgl serve --disaggregation-mode servers)")
    if worker_urls or workers is not None or worker_args or dp_aware:
        raise click.UsageError("--pd-disaggregation routes to --prefill and --decode servers; "
                               "--worker-urls, --workers, --dp-aware and worker arguments "
                               "after -- are for the regular mode")
    for value in prefill:
        url, _, bootstrap = value.partition(" ")
        if not url.startswith(("http://", "https://")):
            raise click.UsageError(f"--prefill {url}: expected http://HOST:PORT")
        if bootstrap not in ("", "none") and not 0 < int(bootstrap) < 65536:
            raise click.UsageError(f"--prefill {url} {bootstrap}: the bootstrap port must be "
                                   "1-65535")
    for url in decode:
        if not url.startswith(("http://", "https://")):
            raise click.UsageError(f"--decode {url}: expected http://HOST:PORT")


def _worker_api_key(args: Sequence[str]) -> str | None:
    """The --api-key among the worker arguments (``--api-key K`` or ``--api-key=K``)."""
    for i, arg in enumerate(args):
        if arg == "--api-key" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--api-key="):
            return arg.partition("=")[2]
    return None


def _bootstrap_port(url: str, headers: dict[str, str]) -> int:
    """A prefill server's --disaggregation-bootstrap-port, from its /get_server_info."""
    info = httpx.get(f"{url}/get_server_info", headers=headers, timeout=30).json()
    if info.get("disaggregation_mode") != "prefill":
        raise click.ClickException(f"--prefill {url} is not a prefill server (its "
                                   f"disaggregation_mode is {info.get('disaggregation_mode')!r});"
                                   " start it with sgl serve --disaggregation-mode prefill")
    return int(info["disaggregation_bootstrap_port"])


def _start_worker(index: int, count: int, args: Sequence[str]) -> tuple[str, subprocess.Popen[bytes]]:
    port = _free_port()
    command = [sys.executable, "-m", "sgl", "serve", "--host", "127.0.0.1", "--port", str(port),
               *args]
    proc = subprocess.Popen(command, preexec_fn=lambda: take_core_share(index, count))
    url = f"http://127.0.0.1:{port}"
    logger.info("worker %d of %d: %s (pid %d): sgl serve %s", index + 1, count, url, proc.pid,
                " ".join(args))
    return url, proc


def _wait_healthy(urls: list[str], started: list[subprocess.Popen[bytes]],
                  timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = list(urls)
    while waiting:
        for proc in started:
            if proc.poll() is not None:
                raise click.ClickException(f"a worker (pid {proc.pid}) exited with status "
                                           f"{proc.returncode} before it was ready; see its log "
                                           "above")
        for url in list(waiting):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    waiting.remove(url)
            except httpx.HTTPError:
                pass
        if waiting and time.monotonic() > deadline:
            raise click.ClickException(f"workers not healthy after {timeout:.0f} s: "
                                       f"{', '.join(waiting)} (--worker-startup-timeout)")
        time.sleep(0.3)


def _dp_size(url: str, headers: dict[str, str]) -> int:
    """A worker's data-parallel replicas (what the router registers with --dp-aware)."""
    info = httpx.get(f"{url}/get_server_info", headers=headers, timeout=30).json()
    return int(info.get("dp_size") or 1)


def _run_router(command: list[str], url: str, expected: int, policy: str,
                headers: dict[str, str]) -> int:
    proc = subprocess.Popen(command)
    previous = {sig: signal.signal(sig, lambda *_: proc.terminate())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ready = False
        while proc.poll() is None:
            if not ready:
                ready = _registered(url, headers) >= expected
                if ready:
                    logger.info("sgl router is ready: %s, policy %s, in front of %d worker(s)",
                                url, policy, expected)
            time.sleep(0.5)
        return 0 if proc.returncode in (0, -signal.SIGTERM) else proc.returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def _registered(url: str, headers: dict[str, str]) -> int:
    try:
        return len(httpx.get(f"{url}/get_loads", headers=headers, timeout=2).json()["workers"])
    except (httpx.HTTPError, KeyError, ValueError, TypeError):
        return 0


def _stop(started: list[subprocess.Popen[bytes]]) -> None:
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host
