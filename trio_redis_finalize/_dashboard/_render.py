"""Server-side HTML and SVG of the dashboard's pages (no template engine, no CDN)."""

from __future__ import annotations

import datetime
import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from ._actions import Plan
from ._data import Overview, Row
from ._discover import Sub

__all__ = ["chart", "dead_page", "histogram", "layout", "overview_body", "sub_page"]

COLORS = {"ack": "#2e7d32", "retry": "#ef8f00", "drop": "#6d6d6d", "dead": "#c62828"}


def e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.0f} min"
    return f"{value / 3600:.1f} h"


def sub_url(root: str, sub: Sub) -> str:
    q = {"group": sub.group} if sub.group else {}
    return f"{root}/sub/{quote(sub.key, safe='')}" + (f"?{urlencode(q)}" if q else "")


def dead_url(root: str, key: str, **query: Any) -> str:
    q = {k: v for k, v in query.items() if v not in (None, "")}
    return f"{root}/dead/{quote(key, safe='')}" + (f"?{urlencode(q)}" if q else "")


def layout(title: str, body: str, *, root: str, read_only: bool, who: str | None,
           note: str = "", refresh: float | None = None) -> str:
    mode = ("<span class='badge ro' id='mode'>read-only</span>" if read_only
            else f"<span class='badge rw' id='mode'>actions on{' (' + e(who) + ')' if who else ''}</span>")
    live = f" data-refresh='{refresh:g}'" if refresh else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>{e(title)} - trio_redis_finalize</title>
<link rel="stylesheet" href="{root}/static/dashboard.css">
<script src="{root}/static/dashboard.js" defer></script></head>
<body><header><a class="brand" href="{root}/">trio_redis_finalize</a>
<nav><a href="{root}/">Overview</a></nav>{mode}</header>
{f'<p class="note" id="note">{e(note)}</p>' if note else ''}
<main id="live"{live}>{body}</main>
<footer>rendered on the server{f'; refreshes itself every {refresh:g} s' if refresh else ''}</footer></body></html>"""


def chart(history: Mapping[str, Sequence[int]], width: int = 182, height: int = 36) -> str:
    """The last hour, per minute: stacked bars of acked, retried, dropped and
    dead-lettered messages (SVG), the newest minute on the right."""
    names = ("ack", "retry", "drop", "dead")
    n = max((len(history.get(c, [])) for c in names), default=0)
    if n == 0:
        return "<svg class='chart' width='0' height='0'></svg>"
    stacks = [[history.get(c, [0] * n)[i] for c in names] for i in range(n)]
    top = max([1, *(sum(s) for s in stacks)])
    step = (width - 2) / n
    bars = []
    for i, stack in enumerate(stacks):
        y = height - 1.0
        for c, v in zip(names, stack, strict=True):
            if not v:
                continue
            h = max(1.0, v * (height - 4) / top)
            y -= h
            bars.append(f"<rect x='{1 + i * step:.1f}' y='{y:.1f}' width='{max(1.0, step - 1):.1f}' "
                        f"height='{h:.1f}' fill='{COLORS[c]}'/>")
    total = {c: sum(history.get(c, [])) for c in names}
    label = ", ".join(f"{c} {total[c]}" for c in names)
    return (f"<svg class='chart' role='img' width='{width}' height='{height}' "
            f"viewBox='0 0 {width} {height}'><title>last hour, per minute: {e(label)}</title>"
            f"<rect x='0' y='0' width='{width}' height='{height}' fill='#fafafa' stroke='#ddd'/>"
            + "".join(bars) + "</svg>"
            + f"<div class='legend'>{' '.join(_dot(c, total[c]) for c in names if total[c])}</div>")


def _dot(c: str, n: int) -> str:
    return f"<span style='color:{COLORS[c]}'>&#9679;</span>{e(c)} {n}"


def histogram(reasons: Mapping[str, int], link: Any = None, width: int = 360) -> str:
    """Horizontal bars of the dead letters' reasons (SVG)."""
    if not reasons:
        return "<p>no dead letters</p>"
    items = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    top = max(v for _, v in items)
    h = 22 * len(items)
    bars = []
    for i, (r, n) in enumerate(items):
        w = max(2, int((width - 210) * n / top))
        y = i * 22
        label = e(r if len(r) <= 22 else r[:21] + "...")
        bar = (f"<text x='0' y='{y + 15}'>{label}</text>"
               f"<rect x='160' y='{y + 4}' width='{w}' height='14' fill='#c62828'/>"
               f"<text x='{166 + w}' y='{y + 15}'>{n}</text>")
        if link is not None:
            bar = f"<a href='{e(link(r))}'>{bar}</a>"
        bars.append(bar)
    return (f"<svg class='hist' role='img' width='{width}' height='{h}' viewBox='0 0 {width} {h}'>"
            f"<title>dead letters by reason</title>{''.join(bars)}</svg>")


def _level_class(row: Row) -> str:
    return ("bad", "warn", "ok")[row.level]


def overview_body(ov: Overview, root: str, render_ms: float | None = None) -> str:
    rows = []
    for r in ov.rows:
        s = r.sub
        problems = "".join(f"<li class='{lvl}'>{e(t)}</li>" for lvl, t in r.problems)
        if r.error:
            problems += f"<li class='bad'>{e(r.error)}</li>"
        overdue = ("-" if r.overdue is None else
                   f"overdue {_secs(r.overdue)}" if r.overdue > 0 else f"next in {_secs(-r.overdue)}")
        dead = "-"
        if s.dead_letter:
            dead = f"<a href='{e(dead_url(root, s.dead_letter))}'>{e(r.dead_depth)}</a>"
        lag = "-" if r.lag is None else f"{r.lag}{'+' if r.lag_capped else ''}"
        rows.append(f"""<tr class="{_level_class(r)}" data-sub="{e(s.name)}">
<td><span class="dot {_level_class(r)}"></span><a href="{e(sub_url(root, s))}">{e(s.key)}</a>
<div class="sub">{e(s.kind)}{' group ' + e(s.group) if s.group else ''}</div>
<div class="sub path" title="the server path">path: {e(r.path)}</div></td>
<td>{chart(r.history)}</td><td class="num lag">{e(lag)}</td><td class="num">{r.pending}</td>
<td class="num">{_secs(r.oldest_pending_idle)}</td>
<td class="num">{r.delay_size}<div class="sub">{e(overdue)}</div></td><td class="num">{dead}</td>
<td class="consumers"><span class="alive">{r.alive} alive</span> / <span class="lapsed">{r.lapsed} lapsed</span>
/ {r.stopped} stopped{'<div class="stranded">stranded ' + str(r.stranded) + ': ' + e(', '.join(r.stranded_consumers)) + '</div>' if r.stranded else ''}</td>
<td><ul class="problems">{problems}</ul></td></tr>""")
    dead_rows = "".join(
        f"<li><a href='{e(dead_url(root, d.key))}'>{e(d.key)}</a> ({e(d.kind)}"
        f"{', from ' + e(d.source) if d.source else ''}{' / ' + e(d.group) if d.group else ''})</li>"
        for d in ov.dead)
    bad = sum(1 for r in ov.rows if r.level == 0)
    warn = sum(1 for r in ov.rows if r.level == 1)
    stamp = datetime.datetime.fromtimestamp(ov.now_ms / 1000, tz=datetime.UTC).strftime("%H:%M:%S UTC")
    timing = f", rendered in {render_ms:.0f} ms" if render_ms is not None else ""
    return f"""<h1>Overview</h1>
<p class="summary"><b>{len(ov.rows)}</b> subscriptions: <span class="bad">{bad} with problems</span>,
<span class="warn">{warn} to watch</span>; server time {stamp}; {ov.commands} commands in
{ov.round_trips} round trips{timing}</p>
<table class="overview"><thead><tr><th>subscription</th><th>last hour (per minute)</th><th>lag</th>
<th>pending</th><th>oldest pending idle</th><th>delay set</th><th>dead letters</th><th>consumers</th>
<th>problems</th></tr></thead><tbody>{''.join(rows) or '<tr><td colspan=9>no subscriptions found</td></tr>'}</tbody></table>
<h2>Dead letters</h2><ul class="deadlist">{dead_rows or '<li>none found</li>'}</ul>"""


def _table(head: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "") -> str:
    th = "".join(f"<th>{e(h)}</th>" for h in head)
    thead = f"<thead><tr>{th}</tr></thead>" if any(head) else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table class='{cls}'>{thead}<tbody>{body}</tbody></table>"


def sub_page(sub: Sub, info: dict[str, Any], root: str, path: str) -> str:
    parts = [f"<h1>{e(sub.name)}</h1><p class='sub'>{e(sub.kind)}</p>"]
    ds = info["delay_set"]
    due = ds.get("oldest_due_in")
    due_text = "-" if due is None else (f"due in {_secs(due)}" if due >= 0 else f"overdue by {_secs(-due)}")
    facts = [("length", str(info.get("length", "-"))), ("delay set", f"{e(ds['key'])}: {ds['size']}, next {due_text}")]
    if sub.kind == "stream":
        g = info["groups"][0] if info["groups"] else {}
        ret = info["retention"]
        facts += [("lag", e(g.get("lag", "-"))), ("pending", e(g.get("pending", "-"))),
                  ("last delivered", e(g.get("last_delivered_id", "-"))),
                  ("retention", f"oldest needed {e(ret['oldest_needed_id'] or '-')}; a trim would remove "
                                f"{ret['trimmable']}{'+' if ret['trimmable_capped'] else ''} entries")]
        if sub.dead_letter:
            facts.append(("dead letter", f"<a href='{e(dead_url(root, sub.dead_letter))}'>{e(sub.dead_letter)}</a>"))
        parts.append(_table(["", ""], facts, "facts"))
        parts.append("<h2>Consumers</h2>")
        parts.append(_table(["consumer", "pending", "idle", "heartbeat", "stranded"], [
            [e(c["name"]), str(c["pending"]), _secs(c["idle"]),
             f"<span class='{e(c['heartbeat'])}'>{e(c['heartbeat'])}</span>"
             + (f" (expires in {_secs(c['heartbeat_ttl'])})" if c["heartbeat_ttl"] else ""),
             "<b class='bad'>yes</b>" if c["stranded"] else "-"]
            for c in g.get("consumer_list", [])], "consumers"))
        parts.append("<h2>Pending entries</h2>")
        page = info["pending_page"]
        parts.append(_table(["entry", "consumer", "idle", "attempt"], [
            [e(p["id"]), e(p["consumer"]), _secs(p["idle"]), str(p["attempt"])] for p in page], "pending"))
        if len(page) >= 50:
            parts.append(f"<p><a href='{e(path)}&after={e(page[-1]['id'])}'>next page</a></p>")
    else:
        parts.append(_table(["", ""], facts, "facts"))
        parts.append("<h2>Consumers (processing lists)</h2>")
        parts.append(_table(["owner", "processing list", "length", "heartbeat"], [
            [e(p["owner"]), e(p["key"]), str(p["length"]),
             f"alive (age {_secs(p['heartbeat_age'])})" if p["alive"] else "<b class='bad'>lapsed</b>"]
            for p in info["processing"]], "consumers"))
        parts.append("<h2>In processing</h2>")
        parts.append(_table(["owner", "attempt", "origin", "data"], [
            [e(p["owner"]), str(p["attempt"]), e(p["origin"] or "-"), e(p["data"])]
            for p in info["pending_page"]], "pending"))
    return "".join(parts)


def _form(root: str, key: str, action: str, label: str, csrf: str, fields: Mapping[str, Any],
          cls: str = "", disabled: bool = False) -> str:
    hidden = "".join(f"<input type='hidden' name='{e(k)}' value='{e(v)}'>"
                     for k, v in fields.items() if v is not None)
    return (f"<form method='post' class='inline' action='{e(dead_url(root, key))}/{action}'>"
            f"<input type='hidden' name='csrf' value='{e(csrf)}'>{hidden}"
            f"<button type='submit' class='{cls}'{' disabled' if disabled else ''}>{e(label)}</button></form>")


def dead_page(info: dict[str, Any], root: str, csrf: str, read_only: bool, reason: str | None) -> str:
    key = info["key"]
    parts = [f"<h1>Dead letter {e(key)}</h1>"]
    if info["kind"] not in ("stream", "list"):
        what = "does not exist" if info["kind"] == "none" else f"is a {info['kind']}"
        return parts[0] + f"<p class='bad' id='not-a-sub'>{e(key)} {e(what)}: not a dead letter.</p>"
    capped = f" (the oldest {sum(info['reasons'].values())})" if info["capped"] else ""
    parts.append(f"<p>{e(info['kind'])}, {info['length']} messages. Reasons{capped}:</p>")
    parts.append(histogram(info["reasons"], lambda r: dead_url(root, key, reason=r)))
    if reason:
        parts.append(f"<p>showing reason <b>{e(reason)}</b> - <a href='{e(dead_url(root, key))}'>all</a></p>")
    ro = read_only
    bulk = []
    if info["kind"] == "stream":
        if reason:
            bulk.append(_form(root, key, "requeue", f"requeue all '{reason}'", csrf,
                              {"scope": "reason", "reason": reason}, "requeue", ro))
            bulk.append(_form(root, key, "delete", f"delete all '{reason}'", csrf,
                              {"scope": "reason", "reason": reason}, "danger", ro))
    bulk.append(_form(root, key, "requeue", "requeue all", csrf, {"scope": "all"}, "requeue", ro))
    bulk.append(_form(root, key, "delete", "delete all", csrf, {"scope": "all"}, "danger", ro))
    if ro:
        parts.append("<p class='note'>read-only: actions need --token or --basic-auth (and no --read-only)</p>")
    parts.append(f"<div class='bulk'>{''.join(bulk)}</div>")
    rows: list[Any] = []
    if info["kind"] == "stream":
        for en in info["entries"]:
            d = en["dead"] or {}
            fields = " ".join(f"{k}={v}" for k, v in en["fields"].items())
            actions = (_form(root, key, "requeue", "requeue", csrf,
                             {"scope": "ids", "id": en["id"]}, "requeue", ro)
                       + _form(root, key, "delete", "delete", csrf, {"scope": "ids", "id": en["id"]},
                               "danger", ro))
            rows.append(f"<tr data-id='{e(en['id'])}'><td><input type='checkbox' form='selected' "
                        f"name='id' value='{e(en['id'])}'{' disabled' if ro else ''}></td>"
                        f"<td>{e(en['id'])}</td><td>{e(en['time'] or '-')}</td>"
                        f"<td class='reason'>{e(d.get('reason', '-'))}</td><td>{e(d.get('error', '-'))}</td>"
                        f"<td>{e(d.get('source', '-'))}</td><td>{e(d.get('id', '-'))}</td>"
                        f"<td>{e(d.get('group', '-'))}</td><td>{e(d.get('attempt', '-'))}</td>"
                        f"<td class='fields'>{e(fields)}</td><td class='actions'>{actions}</td></tr>")
        parts.append(
            f"<form id='selected' method='post' action='{e(dead_url(root, key))}/requeue'>"
            f"<input type='hidden' name='csrf' value='{e(csrf)}'><input type='hidden' name='scope' value='ids'>"
            f"<button type='submit' class='requeue'{' disabled' if ro else ''}>requeue selected</button></form>")
        parts.append("<table class='dead'><thead><tr><th></th><th>entry</th><th>dead-lettered at</th>"
                     "<th>reason</th><th>error</th><th>source</th><th>source id</th><th>group</th>"
                     "<th>attempt</th><th>fields</th><th></th></tr></thead><tbody>"
                     + "".join(rows) + "</tbody></table>")
        if info.get("more") and info["entries"]:
            parts.append(f"<p><a href='{e(dead_url(root, key, reason=reason, after=info['entries'][-1]['id']))}'>"
                         "next page</a></p>")
    else:
        for en in info["entries"]:
            d = en["dead"] or {}
            rows.append([str(en["index"]), e(en["time"] or "-"), e(d.get("reason", "-")),
                         e(d.get("error", "-")), e(d.get("source", "-")), e(d.get("attempt", "-")),
                         e(en["origin"] or "-"), e(en["data"])])
        parts.append(_table(["#", "dead-lettered at", "reason", "error", "source", "attempt", "origin",
                             "data"], rows, "dead"))
    return "".join(parts)


def confirm_page(p: Plan, root: str, csrf: str, force: bool) -> str:
    fields: dict[str, Any] = {"scope": p.scope, "reason": p.reason, "confirm": "yes",
                              "count": p.count, "upto": p.upto}  # what the confirmation acts on
    ids = "".join(f"<input type='hidden' name='id' value='{e(i)}'>" for i in p.ids)
    refusal = ""
    if p.refusal:
        refusal = (f"<p class='bad' id='refusal'>{e(p.refusal)}</p>"
                   "<label><input type='checkbox' name='force' value='yes' id='force'> force: move anyway</label>")
    elif force:
        fields["force"] = "yes"
    hidden = "".join(f"<input type='hidden' name='{e(k)}' value='{e(v)}'>"
                     for k, v in fields.items() if v is not None)
    capped = " (counted among the oldest 5000)" if p.capped else ""
    return f"""<h1>Confirm</h1><p class="confirm" id="plan">This will {e(p.describe())}{capped}.</p>
<form method="post" action="{e(dead_url(root, p.key))}/{p.action}" id="confirm-form">
<input type="hidden" name="csrf" value="{e(csrf)}">{hidden}{ids}{refusal}
<button type="submit" id="confirm" class="{'danger' if p.action == 'delete' else 'requeue'}">{e(p.action)} {p.count}</button>
<a href="{e(dead_url(root, p.key))}" id="cancel">cancel</a></form>"""


def message_page(title: str, text: str, back: str, cls: str = "") -> str:
    return f"<h1>{e(title)}</h1><p class='{cls}' id='message'>{e(text)}</p><p><a href='{e(back)}'>back</a></p>"
