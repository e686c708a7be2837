"""The Ray dashboard in a real headless Chromium lists a running zeroray job's rank actors by name.

A 2-worker ZeroTrainer run reports once and then holds its actors alive until the test releases
them. Chromium (Debian's package) is driven through the DevTools protocol over a websocket (aiohttp,
which Ray's dashboard already depends on): it opens the dashboard's actors page, the test polls the
rendered DOM's text until every rank's row shows its actor name and ALIVE, then takes a screenshot.
``ZERORAY_UPDATE_SCREENSHOTS=1`` writes it over docs/images/ray-dashboard-actors.png. Every wait polls
a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import stop
from tests.support.ray import run_config

RUN = "dashboard-run"
WORKERS = 2
DEADLINE_S = 60.0
WIDTH, HEIGHT = 1400, 760
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "images" / "ray-dashboard-actors.png"


def _loop(config: dict[str, Any]) -> None:
    """Train a few steps, then keep the actors alive until the test writes the release file (bounded)."""
    import torch

    import zeroray.train as zt
    from zeroray.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    engine = zt.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(3):
        x = torch.randint(0, 64, (2, 16))
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        zt.report({"loss": loss.item()})
    deadline = time.monotonic() + config["max_s"]
    while not Path(config["release"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture
def chromium() -> str:
    """The binary, or a skip that names it, before the Ray cluster starts (the test requests this first)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("no chromium binary: `apt-get install -y chromium` (.ci/run installs it when apt exists)")


class Chromium:
    """A headless Chromium with the DevTools protocol on a port of its choosing."""

    def __init__(self, binary: str, workdir: Path) -> None:
        workdir.mkdir()
        self.profile = workdir / "profile"
        self.log = (workdir / "chromium.log").open("w")
        root = ["--no-sandbox"] if os.geteuid() == 0 else []  # Chromium's sandbox refuses to run as root
        self.proc = subprocess.Popen(
            [binary, "--headless", *root, "--disable-gpu", "--no-first-run", "--no-default-browser-check",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile}", f"--window-size={WIDTH},{HEIGHT}",
             "about:blank"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def page_websocket(self) -> str:
        """The DevTools websocket of the browser's page, once Chromium has written its port."""
        active = self.profile / "DevToolsActivePort"
        port = _wait(lambda: active.exists() and active.read_text().split("\n")[0].strip(), "DevToolsActivePort",
                     self.proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
            targets = json.loads(r.read())
        return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")

    def close(self) -> None:
        stop(self.proc)
        self.log.close()


def _wait(cond, what: str, proc: subprocess.Popen | None = None, timeout_s: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"chromium exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


# The text of every table row that names one of the run's actors (the actors page is one table).
_ROWS_JS = """Array.from(document.querySelectorAll('tr'))
  .map(tr => tr.innerText.replace(/\\s+/g, ' ').trim())
  .filter(t => t.includes('zeroray:%s:'))"""


def _auth_header() -> str | None:
    """The cluster's token as an Authorization header value, when Ray's token authentication is on
    (Ray's default: the dashboard then asks for the token, which ``ray get-auth-token`` prints)."""
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

    headers = get_auth_headers_if_auth_enabled({})
    return next((v for k, v in headers.items() if k.lower() == "authorization"), None)

_FOCUS_NAME_FILTER_JS = """(() => {
  const input = Array.from(document.querySelectorAll('input')).find(i => i.placeholder === 'Name'
    || Array.from(i.labels || []).some(l => l.innerText.trim() === 'Name'));
  if (!input) return '[]';
  input.focus();
  return JSON.stringify([document.activeElement === input]);
})()"""


async def _actors_page(ws_url: str, dashboard: str, names: list[str], auth: str | None) -> tuple[list[str], bytes]:
    """Open the dashboard's actors page (after signing in with the token, as its token dialog does);
    wait until each name's row says ALIVE; return the rows and a PNG of the page."""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        ids = iter(range(1, 1_000_000))

        async def call(method: str, **params: Any) -> dict[str, Any]:
            i = next(ids)
            await ws.send_json({"id": i, "method": method, "params": params})
            while True:  # skip events and other replies
                msg = await asyncio.wait_for(ws.receive_json(), timeout=DEADLINE_S)
                if msg.get("id") == i:
                    if "error" in msg:
                        raise AssertionError(f"DevTools {method}: {msg['error']}")
                    return msg["result"]

        await call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1,
                   mobile=False)
        async def until(expression: str, what: str) -> list[Any]:
            """Poll a JS expression (JSON text of a list) until it is non-empty."""
            deadline = time.monotonic() + DEADLINE_S
            while True:
                result = await call("Runtime.evaluate", expression=expression, returnByValue=True)
                value = json.loads(result["result"].get("value") or "[]")
                if value:
                    return value
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out waiting for {what}")
                await asyncio.sleep(0.25)

        if auth is not None:  # sign in from a page of the dashboard's origin that is not the app itself:
            # the app, loaded before, would keep its token dialog open
            await call("Page.navigate", url=f"{dashboard}/favicon.ico")
            await until(f"JSON.stringify(location.href.startsWith({json.dumps(dashboard)}) "
                        "&& document.readyState !== 'loading' ? [1] : [])", "the dashboard's page to load")
            signed_in = await call("Runtime.evaluate", awaitPromise=True, returnByValue=True, expression=(
                f"fetch('/api/authenticate', {{method: 'POST', headers: {{Authorization: {json.dumps(auth)}}}}})"
                ".then(r => r.status)"))
            assert signed_in["result"].get("value") == 200, signed_in
        await call("Page.navigate", url=f"{dashboard}/#/actors")
        # Type the run's prefix into the table's Name filter, as a user would: other runs' actors (dead
        # ones stay listed) could otherwise push this run's off the first page.
        await until(_FOCUS_NAME_FILTER_JS, "the actors table's Name filter")
        await call("Input.insertText", text=f"zeroray:{RUN}:")
        alive = " && ".join(f"rows.some(t => t.includes({json.dumps(n)}) && t.includes('ALIVE'))" for n in names)
        rows = await until(f"(() => {{ const rows = {_ROWS_JS % RUN}; return JSON.stringify({alive} ? rows : []) }})()",
                           f"the dashboard's actors page to list {names} as ALIVE")
        shot = await call("Page.captureScreenshot", format="png")
        return rows, base64.b64decode(shot["data"])


def test_ray_dashboard_lists_the_rank_actors(chromium, ray_cluster, tmp_path):
    from ray._private.worker import get_dashboard_url

    from zeroray.train import ScalingConfig, ZeroTrainer
    from zeroray.train.group.rank_actor import actor_name

    binary = chromium
    release = tmp_path / "release"
    trainer = ZeroTrainer(
        _loop,
        train_loop_config={"release": str(release), "max_s": DEADLINE_S},
        zero_config={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2},
        scaling_config=ScalingConfig(num_workers=WORKERS),
        run_config=run_config(tmp_path, RUN),
    )
    result: dict[str, Any] = {}
    fit = threading.Thread(target=lambda: result.update(r=trainer.fit()), daemon=True)
    fit.start()
    browser = Chromium(binary, tmp_path / "chromium")
    try:
        names = [actor_name(RUN, r) for r in range(WORKERS)]
        rows, png = asyncio.run(
            _actors_page(browser.page_websocket(), f"http://{get_dashboard_url()}", names, _auth_header()))
    finally:
        release.write_text("")
        browser.close()
        fit.join(timeout=2 * DEADLINE_S)
    assert "r" in result and result["r"].error is None
    assert len(rows) == WORKERS, rows  # the filter left this run's ranks only
    for name in names:
        row = next(r for r in rows if name in r)
        assert "ALIVE" in row and "RankActor" in row, row

    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    (tmp_path / "actors.png").write_bytes(png)
    if os.environ.get("ZERORAY_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        SCREENSHOT.write_bytes(png)
