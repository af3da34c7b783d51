"""The Run page as one self-contained HTML report, and the rendering every page of
the web UI shares (the Jinja2 environment, :func:`render_page`).

:func:`write_report` writes the performance report of any recorded run, without the
run having been wrapped in ``performance_report``: one HTML file holding every panel
of the Run page (:mod:`.views`: the diagnosis, the task stream, the critical path and
cost, progress, task groups, the task graph, workers, memory, processing, spans, fine
performance metrics, failures with each erred task's story and traceback, logs),
with BokehJS and the styles inline, so it opens with no network. :func:`render_run`
draws it from :func:`dask_blackbox.read.views.run_data`: every figure in one Bokeh
document (its references computed once), so every time axis shares one range.

Charts are Bokeh documents (the library Dask's dashboard and ``performance_report``
are built with; :mod:`.figures`), embedded with :func:`bokeh.embed.file_html` into a
Jinja2 template rendered with autoescaping on: a task key, log line or exception
containing HTML is shown as text.
"""

from __future__ import annotations

import html
import pathlib
import time
from typing import NamedTuple

from bokeh.document import Document
from bokeh.embed.bundle import bundle_for_objs_and_resources
from bokeh.embed.elements import html_page_for_render_items
from bokeh.embed.util import standalone_docs_json_and_render_items
from bokeh.models import ColumnDataSource, HoverTool
from bokeh.plotting import figure
from bokeh.resources import INLINE, Resources

from dask_blackbox.read import palette, views
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.templates import env, fmt_s
from dask_blackbox.read.views.page import LEVELS
from dask_blackbox.read.views.scope import Scope


def color_of(name: str) -> str:
    """Dask's colour for a task prefix (the task stream's and progress bars')."""
    return palette.color_of(name)


def _document(figures: dict) -> Document:
    """One document holding every figure, its references computed once (adding
    roots one by one recomputes them per root)."""
    doc = Document()
    with doc.models.freeze():
        for fig in figures.values():
            doc.add_root(fig)
    return doc


# -------------------------------------------------------------------- render


def _bokeh_resources(web: bool, root_url: str):
    return Resources(mode="server", root_url=root_url) if web else INLINE


def _file_html(doc: Document, resources, title: str, template, variables: dict) -> str:
    """:func:`bokeh.embed.file_html` of every root of ``doc`` (made by
    :func:`_document`), the same page: the same document JSON, BokehJS bundle and
    template, without the two walks over every model that draw nothing --
    Bokeh's document validation (log-only checks; the report's tests run it on the
    report's document) and the search for Python callbacks (its figures have none)."""
    docs_json, render_items = standalone_docs_json_and_render_items(doc, suppress_callback_warning=True)
    bundle = bundle_for_objs_and_resources([doc], resources)
    return html_page_for_render_items(bundle, docs_json, render_items, title=title,
                                      template=template, template_variables=variables)


def web_resources(root_url: str = "./") -> str:
    """The script tags of BokehJS for a web page that draws panels as they load:
    Bokeh and its widgets (the graph's colour choice), from the UI's ``/static``,
    deferred: the page's script asks for its first panels while BokehJS loads, and
    draws them once it has run (``ui/loader.html``)."""
    tags = Resources(mode="server", root_url=root_url, components=["bokeh", "bokeh-widgets"]).js_files
    return "\n".join(f'<script defer src="{html.escape(src)}"></script>' for src in tags)


class RunDocument(NamedTuple):
    """The Run page's figures drawn: ``doc`` holds every figure, ``names`` are the
    figures drawn, ``variables`` what their drawing gives the template
    (:attr:`views.View.draw`)."""

    doc: Document
    names: set[str]
    variables: dict


def run_document(data: dict, web: bool = False, arrivals: views.Arrivals | None = None) -> RunDocument:
    """Every figure of the Run page of :func:`views.run_data`, in one Bokeh document;
    with ``arrivals`` (``data`` still being read), each view drawn once its data came."""
    from dask_blackbox.read.figures import Figures

    wait = arrivals.wait if arrivals is not None else lambda *names: data
    head = wait()
    figures = Figures(head["scope"], head["markers"], web)
    extra: dict = {}
    for view in views.RUN_VIEWS:
        if view.draw is not None:
            extra.update(view.draw(figures, wait(view.name), None))
    built = {k: v for k, v in figures.figures.items() if v is not None}
    return RunDocument(_document(built), set(built), extra)


def render_run(data: dict, web: bool = False, root_url: str = "/", query: dict | None = None,
               query_string: str = "", arrivals: views.Arrivals | None = None) -> str:
    """The Run page of :func:`views.run_data` as HTML, every panel drawn:
    self-contained (BokehJS inline) unless ``web``, where BokehJS comes from
    ``root_url``static/. With ``arrivals``, ``data`` is still being read (:func:`run_document`)."""
    drawn = run_document(data, web, arrivals)
    if arrivals is not None:
        arrivals.wait("span_names")
    scope: Scope = data["scope"]
    title = f"{scope.cluster_name} - dask-blackbox"
    variables = {
        "web": web, "lazy": False, "data": data, "scope": scope, "query": query or {},
        "has": drawn.names, "levels": LEVELS, "views": views.RUN_VIEWS,
        "head": data["summary"], "span_names": data.get("span_names", []),
        "generated": time.time(), "page_title": title, "query_string": query_string,
        "worker_address": None, **drawn.variables,
    }
    template = env().get_template("run.html")
    return _file_html(drawn.doc, _bokeh_resources(web, root_url), title, template, variables)


def render_page(name: str, web: bool = True, figures: dict | None = None, root_url: str = "/",
                **variables) -> str:
    """Any other page (clusters, task, compare, error, the web Run and worker pages'
    shells) from its template; ``figures`` are drawn in one Bokeh document."""
    template = env().get_template(name)
    variables.setdefault("web", web)
    if figures:
        variables["has"] = set(figures)
        return _file_html(_document(figures), _bokeh_resources(web, root_url),
                          variables.get("page_title", "dask-blackbox"), template, variables)
    for k, v in (("has", set()), ("bokeh_css", ""), ("bokeh_js", ""), ("plot_script", ""),
                 ("roots", {})):
        variables.setdefault(k, v)
    return template.render(**variables)


def _unique(labels: list[str]) -> list[str]:
    """The labels, a repeated one numbered (a categorical axis needs distinct factors)."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return out


def compare_figures(data: dict) -> dict:
    """Bokeh figures of :func:`panels.compare`: durations and compute by prefix per run, and
    the own seconds of the culprit prefix's frames that grew."""
    runs = _unique(data["runs"])
    metrics = data["metrics"]
    figures = {}
    functions = (data.get("verdict") or {}).get("functions") or {}
    if functions.get("grown"):
        figures["compare_functions"] = _functions_figure(functions)
    if not runs:
        return figures
    fig = figure(name="compare_durations", y_range=runs[::-1], height=int(80 + 40 * len(runs)),
                 sizing_mode="stretch_width", tools="save,reset", toolbar_location="above",
                 title=f"{data['span']}: elapsed and task seconds per run")
    for i, (metric, color) in enumerate((("elapsed_s", "#1f77b4"), ("task_s", "#ff7f0e"))):
        values = [v or 0.0 for v in metrics.get(metric, [0.0] * len(runs))]
        source = ColumnDataSource({"run": runs, "value": values,
                                   "text": [fmt_s(v) for v in values]})
        from bokeh.transform import dodge
        glyph = fig.hbar(y=dodge("run", -0.18 + 0.36 * i, range=fig.y_range), right="value",
                         height=0.34, color=color, source=source,
                         legend_label="elapsed (stop - start)" if i == 0 else "task seconds (Span.duration)")
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=[("run", "@run"), (metric, "@text")]))
    fig.xaxis.axis_label = "seconds"
    figures["compare_durations"] = fig
    compute = {m.removeprefix("compute_s "): v for m, v in metrics.items() if m.startswith("compute_s ")}
    if compute:
        prefixes = list(compute)
        source = ColumnDataSource({"run": runs, **{p: [v or 0.0 for v in compute[p]] for p in prefixes}})
        # tall enough for its legend (a legend taller than its figure is clipped)
        fig = figure(name="compare_compute", y_range=runs[::-1],
                     height=int(max(80 + 40 * len(runs), 70 + 21 * len(prefixes))),
                     sizing_mode="stretch_width", tools="save,reset", toolbar_location="above",
                     title=f"{data['span']}: compute seconds by prefix per run")
        colors = palette.distinct(prefixes)
        fig.hbar_stack(prefixes, y="run", height=0.6, source=source,
                       color=[colors[p] for p in prefixes], legend_label=prefixes)
        fig.add_tools(HoverTool(tooltips=[("run", "@run"), ("prefix", "$name"),
                                          ("seconds", "@$name{0.000}")]))
        fig.add_layout(fig.legend[0], "right")
        figures["compare_compute"] = fig
    return figures


def _functions_figure(functions: dict):
    """The own seconds of the frames whose time grew, baseline beside candidate."""
    from bokeh.transform import dodge

    grown = functions["grown"]
    names = _unique([f"{c['function']} ({c['location']})" for c in grown])
    fig = figure(name="compare_functions", y_range=names[::-1], height=int(90 + 44 * len(names)),
                 sizing_mode="stretch_width", tools="save,reset", toolbar_location="above",
                 title=f"prefix {functions['prefix']}: own seconds of the frames that grew")
    for i, (side, label, color) in enumerate((("seconds_base", "baseline", "#1f77b4"),
                                              ("seconds_new", "candidate", "#ff7f0e"))):
        source = ColumnDataSource({"frame": names, "value": [c[side] for c in grown],
                                   "text": [fmt_s(c[side]) for c in grown],
                                   "verdict": [c["verdict"] for c in grown]})
        glyph = fig.hbar(y=dodge("frame", 0.18 - 0.36 * i, range=fig.y_range), right="value",
                         height=0.34, color=color, source=source, legend_label=label)
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=[
            ("frame", "@frame"), (label, "@text"), ("verdict", "@verdict")]))
    fig.xaxis.axis_label = "seconds (own samples' share x the prefix's compute seconds)"
    return fig


def write_report(path: str | pathlib.Path, cluster: str, span: str | None = None,
                 since=None, until=None, backend: Backend | None = None) -> dict:
    """Write the Run page of ``cluster`` (name or id; optionally narrowed to a span
    and/or a window) to ``path`` as one self-contained HTML file. Returns
    ``{"path", "bytes", "seconds", "cluster_id"}``; raises panels.NotFound for an
    unknown cluster or span."""
    started = time.perf_counter()
    return write_run(path, views.read_run(cluster, span, since, until, backend), started)


def write_run(path: str | pathlib.Path, data: dict, started: float,
              arrivals: views.Arrivals | None = None) -> dict:
    """Write :func:`views.read_run`'s ``data`` as :func:`write_report` does (``started``:
    the :func:`time.perf_counter` when reading began; ``arrivals``: ``data`` is still
    being read, each view is drawn as its data comes)."""
    html = render_run(data, web=False, arrivals=arrivals)
    path = pathlib.Path(path)
    path.write_text(html, encoding="utf-8")
    return {"path": str(path), "bytes": path.stat().st_size,
            "seconds": time.perf_counter() - started, "cluster_id": data["scope"].cluster_id}
