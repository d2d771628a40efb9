LM.render.patch = function (root, p, st, set) {
  const d = p.data, M = d.maps.length;
  const clamp = (v, n) => Math.max(0, Math.min(n - 1, Number.isFinite(+v) ? Math.floor(+v) : 0));
  const k = clamp(st.map, M), m = d.maps[k], X = m.columns.length;
  // an encoder-decoder's maps carry their own layers, corrupted labels and heads flag
  const layers = m.layers || d.layers, L = layers.length, corrupted = m.corrupted || d.corrupted;
  const heads = m.heads !== undefined ? m.heads : m.what === "heads";
  if (!m._v) m._v = unpack(m.values);
  const at = (l, j) => m._v[l * X + j];
  let a = 1;  // colour scale [-a, a]: at least [-1, 1], wider when a score overshoots
  for (let i = 0; i < m._v.length; i++) a = Math.max(a, Math.abs(m._v[i]));
  const ctl = el("div", "ctl");
  ctl.appendChild(select("map", d.maps.map(x => x.what), k, v => set({map: v})));
  root.appendChild(ctl);
  root.appendChild(el("div", "lbl", d.metric));
  root.appendChild(el("div", "lbl", "score = (patched - corrupted) / (clean - corrupted): 1 (red) " +
    "restores the clean value, 0 (white) no effect, negative (blue) pushes further away"));
  const info = el("div", "lbl", "hover a cell"); info.id = "patch-cell";
  root.appendChild(info);
  const cell = Math.max(4, Math.min(28, Math.floor(900 / Math.max(X, 1))));
  const c = el("canvas"); c.id = "patch-map"; c.width = X * cell; c.height = L * cell;
  c.dataset.what = m.what;
  const g = c.getContext("2d");
  const RED = [178, 24, 43], BLUE = [33, 102, 172];
  function diverging(v) {
    const t = Math.max(-1, Math.min(1, v / a)), e = t >= 0 ? RED : BLUE, f = Math.abs(t);
    return "rgb(" + e.map(x => Math.round(255 + f * (x - 255))).join(",") + ")";
  }
  for (let l = 0; l < L; l++) for (let j = 0; j < X; j++) {
    g.fillStyle = diverging(at(l, j));
    g.fillRect(j * cell, l * cell, cell, cell);
  }
  function show(e) {
    const j = clamp(Math.floor(e.offsetX / cell), X), l = clamp(Math.floor(e.offsetY / cell), L), v = at(l, j);
    const patched = d.metric_corrupt + v * (d.metric_clean - d.metric_corrupt);
    const where = heads ? "head " + m.columns[j] + " (all positions)"
      : "position " + j + " \u201c" + m.columns[j] + "\u201d";
    info.textContent = m.what + ", layer " + layers[l] + ", " + where + ": score " + v.toFixed(4) +
      " (patched metric " + patched.toFixed(4) + ")";
    info.dataset.layer = String(l); info.dataset.column = String(j); info.dataset.score = v.toFixed(6);
  }
  c.addEventListener("mousemove", show);
  c.addEventListener("click", show);
  root.appendChild(el("div", "lbl", "rows: layers " + layers[0] + " (top) .. " + layers[L - 1] + "; columns: " + m.axis));
  root.appendChild(c);
  const cols = el("div", "strip"); cols.id = "patch-columns";
  cols.style.gap = "0"; cols.style.flexWrap = "nowrap";  // one label under each map column
  m.columns.forEach((t, j) => {
    const s = el("span", "tok", t);
    s.dataset.j = String(j);
    s.title = (heads ? "head " : "position " + j + ": ") + t;
    Object.assign(s.style, {width: cell + "px", boxSizing: "border-box", padding: "0",
      overflow: "hidden", textAlign: "center", flexShrink: "0", fontSize: cell < 14 ? "8px" : ""});
    if (!heads && j % 10 === 0) s.appendChild(el("sub", "", String(j)));
    cols.appendChild(s);
  });
  root.appendChild(el("div", "lbl", heads ? "heads" : "clean tokens (corrupted: " + corrupted.join(" ") + ")"));
  root.appendChild(cols);
};
