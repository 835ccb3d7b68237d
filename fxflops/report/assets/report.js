// fxflops report: the icicle of the module tree, its zoom and tooltip, and sortable tables.
// Hand-written, no dependencies: the page must open offline, from a file, in any browser.
(function () {
  "use strict";
  var errors = [];
  window.addEventListener("error", function (event) {
    errors.push(String(event.message));
    document.body.setAttribute("data-errors", errors.join(" | "));
  });

  var data = JSON.parse(document.getElementById("fxflops-data").textContent);
  var groups = data.groups;
  var ROW = 28;
  var state = { metric: 0, focus: 0 };
  var parents = [];
  groups.forEach(function (group, index) {
    group.children.forEach(function (child) { parents[child] = index; });
  });
  // An entry "holds" unknown ops when it or any entry below it ran one (children come after parents).
  for (var i = groups.length - 1; i >= 0; i--) {
    groups[i].holdsUnknown = groups[i].unknown.length > 0 ||
      groups[i].children.some(function (child) { return groups[child].holdsUnknown; });
  }
  var MIN_UNKNOWN = 6;  // px: an entry with unknown ops stays visible even when it counts nothing

  // A colour per module class, so repeated layers look alike; golden-angle steps keep classes apart.
  function hue(text) {
    var h = 2166136261;
    for (var i = 0; i < text.length; i++) { h = Math.imul(h ^ text.charCodeAt(i), 16777619) >>> 0; }
    return Math.round((h % 997) * 137.508) % 360;
  }

  function value(index) { return groups[index].v[state.metric]; }

  function ancestors(index) {
    var chain = [];
    for (var at = index; at !== undefined; at = parents[at]) { chain.unshift(at); }
    return chain;
  }

  function percentOf(part, whole) { return whole > 0 ? (100 * part / whole).toFixed(2) + "%" : "-"; }

  function caption(group) {
    return group.count > 1 ? group.label + " (" + group.count + "\u00d7) " : group.label + " ";
  }

  function makeCell(index, left, width, depth, box) {
    var group = groups[index];
    var cell = document.createElement("div");
    cell.className = "cell" + (index === state.focus ? " focus" : "") +
      (group.unknown.length ? " unknown" : group.holdsUnknown ? " holds-unknown" : "");
    cell.style.left = left + "px";
    cell.style.width = Math.max(width, 1) + "px";
    cell.style.top = depth * ROW + "px";
    cell.style.background = "hsl(" + hue(group.type) + ", 55%, " + (78 - Math.min(depth, 6) * 3) + "%)";
    cell.setAttribute("data-index", String(index));
    cell.setAttribute("data-name", group.name);
    cell.setAttribute("tabindex", "0");
    cell.setAttribute("role", "button");
    cell.setAttribute("aria-label", (group.name || data.root) + " (" + group.type + ")");
    cell.appendChild(document.createTextNode(caption(group)));
    var type = document.createElement("span");
    type.className = "type";
    type.textContent = group.type;
    cell.appendChild(type);
    box.appendChild(cell);
  }

  // Lays out `index` and its descendants in [left, left + width); returns the deepest row used.
  function layout(index, left, width, depth, box) {
    makeCell(index, left, width, depth, box);
    var deepest = depth;
    var children = groups[index].children;
    var sum = 0;
    children.forEach(function (child) { sum += value(child); });
    var whole = Math.max(value(index), sum);  // measured latencies of children can exceed the parent's
    // Entries that ran unknown ops but count (almost) nothing get MIN_UNKNOWN px, taken from the rest.
    var tiny = children.filter(function (child) {
      return groups[child].holdsUnknown && (whole > 0 ? width * value(child) / whole : 0) < MIN_UNKNOWN;
    });
    var reserved = Math.min(width / 2, tiny.length * MIN_UNKNOWN);
    var scale = whole > 0 ? (width - reserved) / whole : 0;
    var x = left;
    children.forEach(function (child) {
      var w = tiny.indexOf(child) >= 0 ? reserved / tiny.length : value(child) * scale;
      if (w >= 1) { deepest = Math.max(deepest, layout(child, x, w, depth + 1, box)); }
      x += w;
    });
    return deepest;
  }

  function renderCrumbs() {
    var crumbs = document.getElementById("crumbs");
    crumbs.textContent = "";
    ancestors(state.focus).forEach(function (index, position) {
      if (position) { crumbs.appendChild(document.createTextNode(" \u203a ")); }
      var group = groups[index];
      var link = document.createElement(index === state.focus ? "span" : "a");
      link.textContent = position ? caption(group).trim() : data.model;
      if (index !== state.focus) {
        link.setAttribute("data-index", String(index));
        link.addEventListener("click", function () { zoom(index); });
      }
      crumbs.appendChild(link);
    });
  }

  function render() {
    var box = document.getElementById("icicle");
    box.textContent = "";
    if (!groups.length) { box.innerHTML = '<div class="empty">No modules were recorded.</div>'; return; }
    renderCrumbs();
    var focus = groups[state.focus];
    var drawable = value(state.focus) > 0 || focus.holdsUnknown ||
      focus.children.some(function (child) { return value(child) > 0; });
    if (!drawable) {
      var empty = document.createElement("div");
      empty.className = "empty";
      empty.textContent = (groups[state.focus].name || data.root) + " has no " + data.metrics[state.metric].label + ".";
      box.appendChild(empty);
      box.style.height = "";
      return;
    }
    var deepest = layout(state.focus, 0, box.clientWidth || 1000, 0, box);
    box.style.height = (deepest + 1) * ROW + 2 + "px";
  }

  function zoom(index) {
    state.focus = index;
    document.body.setAttribute("data-focus", groups[index].name);
    render();
    explain(index);
  }

  function explain(index) {
    // the module's own ops, as Estimate.explain prints them (text, never markup)
    var box = document.getElementById("explain");
    if (box) { box.textContent = groups[index].explain || "No explanation was recorded for this estimate."; }
  }

  function indexOf(target) {
    var cell = target && target.closest ? target.closest("[data-index]") : null;
    return cell ? Number(cell.getAttribute("data-index")) : null;
  }

  function clicked(index) {
    if (index === null) { return; }
    if (index === state.focus) {
      if (parents[index] !== undefined) { zoom(parents[index]); }
    } else {
      zoom(index);
    }
  }

  function showTooltip(index, event) {
    var tip = document.getElementById("tooltip");
    var group = groups[index];
    var metric = data.metrics[state.metric];
    var rows = group.info.slice();
    rows.push([(group.n > 1 ? "all " + group.n + ": share of " : "share of ") + metric.label, percentOf(value(index), groups[0].v[state.metric]) + " of the model, " +
      percentOf(value(index), value(state.focus)) + " of the zoomed module"]);
    if (group.unknown.length) { rows.push(["unknown ops", group.unknown.join(", ")]); }
    var table = document.createElement("table");
    rows.forEach(function (row) {
      var tr = table.insertRow();
      tr.insertCell().textContent = row[0];
      tr.insertCell().textContent = row[1];
    });
    tip.textContent = "";
    tip.appendChild(table);
    tip.hidden = false;
    var x = Math.min(event.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    var y = event.clientY + 16;
    if (y + tip.offsetHeight > window.innerHeight) { y = event.clientY - tip.offsetHeight - 10; }
    tip.style.left = Math.max(0, x) + "px";
    tip.style.top = Math.max(0, y) + "px";
  }

  function setUpIcicle() {
    var box = document.getElementById("icicle");
    box.addEventListener("click", function (event) { clicked(indexOf(event.target)); });
    box.addEventListener("keydown", function (event) {
      if (event.key === "Enter" || event.key === " ") { event.preventDefault(); clicked(indexOf(event.target)); }
    });
    box.addEventListener("mousemove", function (event) {
      var index = indexOf(event.target);
      if (index === null) { document.getElementById("tooltip").hidden = true; } else { showTooltip(index, event); }
    });
    box.addEventListener("mouseleave", function () { document.getElementById("tooltip").hidden = true; });
    document.addEventListener("keydown", function (event) {
      if (event.key === "Escape" && parents[state.focus] !== undefined) { zoom(parents[state.focus]); }
    });
    Array.prototype.forEach.call(document.querySelectorAll(".metrics button"), function (button) {
      button.addEventListener("click", function () {
        state.metric = Number(button.getAttribute("data-metric"));
        Array.prototype.forEach.call(document.querySelectorAll(".metrics button"), function (other) {
          other.setAttribute("aria-checked", other === button ? "true" : "false");
        });
        render();
      });
    });
    var pending = null;
    window.addEventListener("resize", function () {
      if (pending) { window.clearTimeout(pending); }
      pending = window.setTimeout(render, 100);
    });
  }

  function sortKey(cell, numeric) {
    if (!cell) { return numeric ? -Infinity : ""; }
    if (numeric) {
      var v = cell.getAttribute("data-v");
      return v === null || v === "" ? -Infinity : Number(v);
    }
    return cell.textContent.toLowerCase();
  }

  function sortTable(table, column, header) {
    var numeric = header.classList.contains("num");
    var descending = header.getAttribute("aria-sort") !== "descending";
    if (!numeric && header.getAttribute("aria-sort") === "none") { descending = false; }
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th) { th.setAttribute("aria-sort", "none"); });
    header.setAttribute("aria-sort", descending ? "descending" : "ascending");
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.forEach(function (row, position) { row.setAttribute("data-order", String(position)); });
    rows.sort(function (a, b) {
      var x = sortKey(a.cells[column], numeric), y = sortKey(b.cells[column], numeric);
      if (x < y) { return descending ? 1 : -1; }
      if (x > y) { return descending ? -1 : 1; }
      return Number(a.getAttribute("data-order")) - Number(b.getAttribute("data-order"));
    });
    rows.forEach(function (row) { body.appendChild(row); });
  }

  function setUpTables() {
    Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
      Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, column) {
        th.addEventListener("click", function () { sortTable(table, column, th); });
      });
    });
    var filter = document.getElementById("filter");
    filter.addEventListener("input", function () {
      var needle = filter.value.toLowerCase();
      Array.prototype.forEach.call(document.querySelectorAll("#modules tbody tr"), function (row) {
        var text = (row.cells[0].textContent + " " + row.cells[1].textContent).toLowerCase();
        row.hidden = needle !== "" && text.indexOf(needle) < 0;
      });
    });
  }

  setUpIcicle();
  setUpTables();
  render();
  if (groups.length) { explain(state.focus); }
  document.body.setAttribute("data-ready", "true");
}());
