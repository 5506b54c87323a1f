"""Screenshots of every dashboard page at desktop (1280x800) and phone (390x844) width.

Seeds a run as bench/dashboard.py does (fewer rounds, so that the charts read well), serves
it, and writes ``<page>-<desktop|phone>.png`` into ``--out`` (full-page shots). With
``--docs`` it also copies the run page's shots to docs/dashboard-run*.png for the README.

    python bench/screenshots.py [--out bench/out/screenshots] [--docs]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dashboard import (
    CHROMIUM,
    CHROMIUM_ARGS,
    REPO,
    create_run,
    database,
    seed,
    server,
)

VIEWPORTS = {"desktop": (1280, 800), "phone": (390, 844)}


def shoot(url: str, run_id: str, out: Path) -> list[Path]:
    from playwright.sync_api import sync_playwright

    pages = {"runs": "#/runs", "run": f"#/runs/{run_id}", "contributors": "#/contributors",
             "join": "#/join"}  # fmt: skip
    written = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for kind, (width, height) in VIEWPORTS.items():
                context = browser.new_context(
                    viewport={"width": width, "height": height}, color_scheme="light"
                )
                page = context.new_page()
                errors: list[str] = []
                page.on("console", lambda m, e=errors: m.type == "error" and e.append(m.text))
                for name, fragment in pages.items():
                    page.goto(f"{url}/{fragment}")
                    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
                    path = out / f"{name}-{kind}.png"
                    page.screenshot(path=str(path), full_page=True)
                    written.append(path)
                context.close()
                if errors:
                    raise SystemExit(f"console errors: {errors}")
        finally:
            browser.close()
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "bench/out/screenshots")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--contributors", type=int, default=12)
    ap.add_argument("--docs", action="store_true", help="copy the run page to docs/")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="diloco-shots-") as tmp_name:
        tmp = Path(tmp_name)
        with database(tmp) as db, server(tmp, db) as url, httpx.Client(base_url=url) as http:
            run = create_run(http, contributors=args.contributors, max_rounds=100)
            seed(db, run, rounds=args.rounds, contributors=args.contributors)
            for path in shoot(url, run["id"], args.out):
                print(path)
    if args.docs:
        for kind in VIEWPORTS:
            target = REPO / "docs" / f"dashboard-run{'' if kind == 'desktop' else '-phone'}.png"
            shutil.copy(args.out / f"run-{kind}.png", target)
            print(target)


if __name__ == "__main__":
    main()
