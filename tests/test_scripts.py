"""The scripts' text as sent to Redis: the prelude cut to what each script uses (pure, no
server; every script runs on every backend in the rest of the suite)."""

from __future__ import annotations

import re

import pytest

from accumulator import _scripts

PRELUDE = """-- header: kept always

-- a: calls b
local function a(x)
  return b(x) + 1
end

-- b
local function b(x)

  return x  -- (a blank line above, inside the body)
end

-- c: nobody's
local function c()
  return 3
end

local K, L = 1, {x = 2,
  y = 3}
"""


def test_only_what_the_body_uses_is_kept_with_its_comment():
    out = _scripts.prelude_for("return a(1)", PRELUDE)
    assert "-- header: kept always" in out
    assert "-- a: calls b" in out and "local function a(x)" in out
    assert "-- b\nlocal function b(x)\n\n  return x" in out  # (its body whole)
    assert "local function c" not in out and "nobody's" not in out
    assert "local K, L" not in out


def test_a_multi_name_definition_and_its_continuation_lines_are_kept():
    out = _scripts.prelude_for("return L.y", PRELUDE)
    assert "local K, L = 1, {x = 2,\n  y = 3}\n" in out
    assert "function a" not in out


def test_the_order_of_the_prelude_is_kept():
    out = _scripts.prelude_for("return a(1) + c()", PRELUDE)
    assert out.index("function a") < out.index("function b") < out.index("function c")


@pytest.mark.parametrize("name", [*_scripts.NAMES, "sync_lease", "sync_count", "purge"])
def test_every_prelude_name_a_script_uses_is_defined_before_it(name):
    """Whatever the pruning leaves out is never named by what it keeps, nor by the script:
    a name the prelude defines and the text uses, defined in the text sent."""
    full = (_scripts._lua_dir() / "_common.lua").read_text()
    defined = set(re.findall(r"^local function (\w+)", full, re.M))
    for names in re.findall(r"^local ([A-Za-z_][\w ,]*?) =", full, re.M):
        defined |= {n.strip() for n in names.split(",")}
    text = _scripts.source(name).decode()
    sent = set(re.findall(r"^local function (\w+)", text, re.M))
    for names in re.findall(r"^local ([A-Za-z_][\w ,]*?) =", text, re.M):
        sent |= {n.strip() for n in names.split(",")}
    code = re.sub(r"--[^\n]*", "", text)  # (comments may name anything)
    used = set(re.findall(r"[A-Za-z_]\w*", code)) & defined
    assert used <= sent, used - sent
    assert len(sent & defined) < len(defined) or name in ("apply", "take")
