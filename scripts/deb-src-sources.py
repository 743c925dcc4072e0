"""Turn the machine's enabled `deb` entries for this Debian release into `deb-src` stanzas (deb822)."""

import glob
import os
import re
import sys

codename = ""
with open("/etc/os-release") as f:
    for line in f:
        if line.startswith("VERSION_CODENAME="):
            codename = line.split("=", 1)[1].strip().strip('"')
if not codename:
    sys.exit("no VERSION_CODENAME in /etc/os-release")


def ours(suites):  # the release's own suites only (bookworm, bookworm-updates, bookworm-security, ...)
    return [s for s in suites if s == codename or s.startswith(codename + "-") or s.startswith(codename + "/")]


stanzas = []
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    with open(path) as f:
        text = f.read()
    for block in re.split(r"\n\s*\n", text):
        fields, key = {}, None
        for line in block.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if line[0] in " \t" and key:
                fields[key] += " " + line.strip()
                continue
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        suites = ours(fields.get("suites", "").split())
        if not suites or not fields.get("uris"):
            continue
        st = {
            "Types": "deb-src",
            "URIs": fields["uris"],
            "Suites": " ".join(suites),
            "Components": fields.get("components", "main"),
        }
        if fields.get("signed-by"):
            st["Signed-By"] = fields["signed-by"]
        stanzas.append(st)

one_line = ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]
for path in one_line:
    if not os.path.exists(path):
        continue
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            m = re.match(r"^deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s*(.*)$", line)
            if not m or not ours([m.group(3)]):
                continue
            st = {"Types": "deb-src", "URIs": m.group(2), "Suites": m.group(3), "Components": m.group(4) or "main"}
            opts = m.group(1) or ""
            sb = re.search(r"signed-by=(\S+?)\]?(\s|$)", opts)
            if sb:
                st["Signed-By"] = sb.group(1).rstrip("]")
            stanzas.append(st)

if not stanzas:
    sys.exit(f"no enabled 'deb' entry for {codename} found in /etc/apt/sources.list(.d)")
with open(sys.argv[1], "w") as out:
    out.write("\n\n".join("\n".join(f"{k}: {v}" for k, v in st.items()) for st in stanzas) + "\n")
