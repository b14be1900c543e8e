"""The HTML template that lets ``dvc plots show`` and ``dvc plots diff`` draw without internet.

DVC's own page loads Vega, Vega-Lite and vega-embed from a CDN (``dvc_render``'s
``VegaRenderer.SCRIPTS``), so offline its Vega plots stay blank, with no message. This
template inlines one bundle of the three instead, made by ``vl-convert-python`` (which ships
their sources: nothing is downloaded), and leaves out DVC's ``{scripts}`` placeholder, so the
page refers to nothing outside itself. ``.dvc/config`` names the file
(``plots.html_template``); ``make install`` writes it (it is generated, ~900 kB, and
git-ignored); ``python -m fedplug.dvc_plots [PATH]`` writes it by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_PATH = Path(".dvc") / "plots" / "offline.html"
"""Where ``.dvc/config``'s ``plots.html_template`` (``plots/offline.html``, relative to
``.dvc/``) points."""
VEGA_LITE_VERSION = "5.21"
"""The newest Vega-Lite 5 that vl-convert bundles: the plot templates in ``.dvc/plots/``
(and DVC's built-in ones) are Vega-Lite v5 specs."""
DVC_PLACEHOLDERS = ("{scripts}", "{plot_divs}", "{refresh_tag}")
"""What ``dvc_render.html.HTML`` replaces in a template; ``{scripts}`` (the CDN tags) is
left out on purpose."""
SNIPPET = """
window.vega = vega;
window.vegaLite = vegaLite;
// DVC's page calls vegaEmbed(element, spec): draw SVG (selectable text, crisp zoom).
window.vegaEmbed = (element, spec, options) => vegaEmbed(element, spec, {renderer: "svg", ...(options || {})});
"""


def page(bundle: str, versions: str) -> str:
    """The template: DVC's page layout with ``bundle`` inlined in place of the CDN scripts.

    Raises:
        ValueError: ``bundle`` holds one of DVC's placeholders (it would be replaced).
    """
    found = [placeholder for placeholder in DVC_PLACEHOLDERS if placeholder in bundle]
    if found:
        raise ValueError(f"the Vega bundle contains {', '.join(found)}, which DVC would replace")
    # Inside a function: the bundle's top-level names stay out of the page's global scope,
    # where DVC declares `var spec` once per plot. `</script` would end the element early.
    script = "(() => {\n" + bundle.replace("</script", "<\\/script") + "\n})();"
    return f"""<!DOCTYPE html>
<html>
<head>
    {{refresh_tag}}
    <meta charset="utf-8">
    <title>DVC Plot</title>
    <!-- {versions}, inlined by fedplug.dvc_plots: this page loads nothing from the network -->
    <script type="text/javascript">
{script}
    </script>
    <style>
        table {{
            border-spacing: 15px;
        }}
    </style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


def write_template(path: str | Path = DEFAULT_PATH) -> Path:
    """Write the template to ``path`` (its folder must exist) and return the path."""
    import vl_convert

    bundle = vl_convert.javascript_bundle(SNIPPET, vl_version=VEGA_LITE_VERSION)
    versions = (
        f"Vega {vl_convert.get_vega_version()}, Vega-Lite {VEGA_LITE_VERSION}, "
        f"vega-embed {vl_convert.get_vega_embed_version()}"
    )
    path = Path(path)
    path.write_text(page(bundle, versions), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "path", nargs="?", default=str(DEFAULT_PATH), help=f"where to write it (default {DEFAULT_PATH})"
    )
    args = parser.parse_args(argv)
    try:
        written = write_template(args.path)
    except ImportError:
        print("fedplug.dvc_plots: vl-convert-python is missing; run `make install` (or pip install "
              "'fedplug[pipeline]')", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"fedplug.dvc_plots: cannot write {args.path}: {error.strerror or error}", file=sys.stderr)
        return 2
    print(f"wrote {written} ({written.stat().st_size // 1000} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
