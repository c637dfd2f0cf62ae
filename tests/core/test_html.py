"""The token page: structure always; a real headless Chromium screenshot where Chromium is installed."""

import shutil
import subprocess

import pytest

from allhere.analysis.html import byte_tokens, token_page


def make_page(tmp_path):
    tokens = byte_tokens(list(b"def f(x):\n    return x\n"))
    counts = [i % 9 for i in range(len(tokens))]
    return token_page(tokens, counts, 8, "test page", tmp_path / "p.html", "a note <escaped>")


def test_page_structure(tmp_path):
    text = make_page(tmp_path).read_text()
    assert text.count('<span class="t"') == 23
    assert "0 of 8 heads global" in text and "all 8 heads global" in text  # the legend
    assert "&lt;escaped&gt;" in text and "rgb(255,255,255)" in text and "rgb(8,48,107)" in text
    with pytest.raises(ValueError):
        token_page(["a"], [1, 2], 8, "t", tmp_path / "q.html")


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium")
def test_page_renders_in_headless_chromium(tmp_path):
    page = make_page(tmp_path)
    shot = tmp_path / "shot.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=900,400",
                    f"--screenshot={shot}", page.as_uri()], check=True, timeout=120, capture_output=True)
    import matplotlib.image

    img = matplotlib.image.imread(str(shot))
    assert img.shape[0] == 400 and img.shape[1] == 900
    blue = ((img[..., 2] > img[..., 0] + 0.2)).sum()  # dark-blue token backgrounds were drawn
    assert blue > 200
