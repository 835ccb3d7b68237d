"""Make the manual's pictures from real runs: the HTML report and a roofline, as PNGs in docs/img/.

Usage: python scripts/docs_images.py     (needs a headless Chromium: `chromium` or `chromium-browser`)

The HTML report is GPT-2 small (`fxflops gpt2-small --device "H100 SXM" --format html`); the roofline
is ResNet-18 at batch 64, 64x64 images, on an H100 SXM (`--roofline`), the run docs/guide/roofline.md
shows. Each picture is a Chromium screenshot of the file fxflops wrote, kept under 300 KB.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "img"
LIMIT = 300 * 1024


def fxflops(*arguments: str) -> None:
    subprocess.run([sys.executable, "-m", "fxflops.cli", *arguments, "--quiet"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)


def screenshot(page: Path, picture: Path, size: str) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("no chromium found: install Debian's chromium (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        f"--user-data-dir={profile}", "--hide-scrollbars", f"--screenshot={picture}",
                        f"--window-size={size}", page.as_uri()],
                       check=True, capture_output=True, timeout=120)
    kib = picture.stat().st_size / 1024
    if picture.stat().st_size > LIMIT:
        sys.exit(f"{picture.name} is {kib:.0f} KiB, over the 300 KiB the manual allows")
    print(f"wrote {picture.relative_to(ROOT)} ({kib:.0f} KiB)")


def main() -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        html = Path(folder) / "gpt2.html"
        fxflops("gpt2-small", "--device", "H100 SXM", "--format", "html", "--output", str(html))
        screenshot(html, IMAGES / "html-report.png", "1200,900")
        svg = Path(folder) / "resnet18.svg"
        fxflops("torchvision:resnet18", "--input-shape", "64,3,64,64", "--device", "H100 SXM", "--roofline", str(svg),
                "--format", "json", "--output", str(Path(folder) / "resnet18.json"))
        screenshot(svg, IMAGES / "roofline.png", "880,560")


if __name__ == "__main__":
    main()
