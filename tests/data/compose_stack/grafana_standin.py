"""A stand-in for Grafana in tests/test_compose_stack.py (Grafana has no Debian package).

At start it reads the provisioning files where Grafana reads them and refuses
(exit 1, so the container never turns healthy) what Grafana would refuse or
show broken: a data source without type, URL or uid; a dashboard provider
whose path holds no dashboard; a panel whose data source is not provisioned
or whose query is empty. Then it answers as Grafana does on /api/health,
/api/search and /api/dashboards/uid/UID.
"""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

PROVISIONING = Path(os.environ.get("GF_PATHS_PROVISIONING", "/etc/grafana/provisioning"))


def panels(items: list[dict]) -> list[dict]:
    out = []
    for p in items:
        out.append(p)
        out += panels(p.get("panels", []))
    return out


def load_datasources(errors: list[str]) -> set:
    """The provisioned data sources' uids; what is wrong with them goes to ``errors``."""
    uids = set()
    for f in sorted((PROVISIONING / "datasources").glob("*.y*ml")):
        doc = yaml.safe_load(f.read_text())
        if doc.get("apiVersion") != 1:
            errors.append(f"{f}: apiVersion must be 1")
        for ds in doc.get("datasources", []):
            for key in ("name", "type", "url", "uid"):
                if not ds.get(key):
                    errors.append(f"{f}: data source without {key}: {ds}")
            uids.add(ds.get("uid"))
    if not uids:
        errors.append("no data source provisioned")
    return uids


def check_panels(d: Path, dash: dict, uids: set, errors: list[str]) -> None:
    """Every panel of dashboard file ``d`` queries a provisioned data source with a query."""
    for p in panels(dash.get("panels", [])):
        if p.get("type") == "row":
            continue
        for t in p.get("targets", []):
            uid = (t.get("datasource") or p.get("datasource") or {}).get("uid")
            if uid not in uids:
                errors.append(f"{d}: panel {p.get('title')!r}: data source {uid!r} not provisioned")
            if not t.get("expr", "").strip():
                errors.append(f"{d}: panel {p.get('title')!r}: empty query")


def load() -> tuple[list[dict], list[str]]:
    errors: list[str] = []
    uids = load_datasources(errors)
    dashboards: list[dict] = []
    for f in sorted((PROVISIONING / "dashboards").glob("*.y*ml")):
        doc = yaml.safe_load(f.read_text())
        for prov in doc.get("providers", []):
            path = Path(prov.get("options", {}).get("path", ""))
            files = sorted(path.glob("*.json")) if path.is_dir() else []
            if prov.get("type") != "file" or not files:
                errors.append(f"{f}: provider {prov.get('name')} finds no dashboard in {path}")
            for d in files:
                dash = json.loads(d.read_text())
                dash["_folder"] = prov.get("folder", "")
                dashboards.append(dash)
                check_panels(d, dash, uids, errors)
    home = os.environ.get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home and not Path(home).is_file():
        errors.append(f"GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH: {home} is no file")
    return dashboards, errors


DASHBOARDS, ERRORS = load()


class Handler(BaseHTTPRequestHandler):
    def reply(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/api/health":
            self.reply(200, {"database": "ok", "version": "stand-in"})
        elif path == "/api/search":
            self.reply(
                200,
                [
                    {
                        "uid": d["uid"],
                        "title": d["title"],
                        "type": "dash-db",
                        "tags": d.get("tags", []),
                        "folderTitle": d["_folder"],
                    }
                    for d in DASHBOARDS
                ],
            )
        elif path.startswith("/api/dashboards/uid/"):
            uid = path.rsplit("/", 1)[1]
            found = [d for d in DASHBOARDS if d["uid"] == uid]
            if found:
                self.reply(200, {"dashboard": found[0]})
            else:
                self.reply(404, {"message": "not found"})
        else:
            self.reply(404, {"message": "not found"})

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    if ERRORS:
        print("grafana stand-in: provisioning refused:", *ERRORS, sep="\n  ", file=sys.stderr)
        sys.exit(1)
    print(f"grafana stand-in: {len(DASHBOARDS)} dashboard(s) provisioned", flush=True)
    ThreadingHTTPServer(("0.0.0.0", 3000), Handler).serve_forever()
