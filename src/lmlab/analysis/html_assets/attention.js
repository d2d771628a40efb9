LM.render.attention = function (root, p, st, set) {
  const d = p.data, L = d.layers.length, H = d.heads.length, Tq = d.queries.length, Tk = d.keys.length;
  if (!d._w) d._w = unpack(d.weights);
  const clamp = (v, n) => Math.max(0, Math.min(n - 1, Number.isFinite(+v) ? Math.floor(+v) : 0));
  const layer = clamp(st.layer, L), head = clamp(st.head, H), tok = clamp(st.token === undefined ? Tq - 1 : st.token, Tq);
  const at = (l, h, i, j) => d._w[((l * H + h) * Tq + i) * Tk + j];
  const [q0, k0] = d.offsets || [0, 0];  // positions of the first query and key
  const allowed = (i, j) => !d.mask || d.mask[i][j] === "1";
  const ctl = el("div", "ctl");
  ctl.appendChild(select("layer", d.layers, layer, v => set({layer: v})));
  ctl.appendChild(select("head", d.heads, head, v => set({head: v})));
  root.appendChild(ctl);
  root.appendChild(el("div", "lbl", "query tokens (hover or click one)"));
  const qs = el("div", "strip"); qs.id = "queries";
  d.queries.forEach((t, i) => {
    const s = el("span", "tok" + (i === tok ? " sel" : ""), t);
    s.dataset.q = String(i);
    s.title = "position " + (q0 + i);
    if ((q0 + i) % 10 === 0) s.appendChild(el("sub", "", String(q0 + i)));
    s.addEventListener("mouseenter", () => { if (i !== tok) set({token: i}); });
    s.addEventListener("click", () => set({token: i}));
    qs.appendChild(s);
  });
  root.appendChild(qs);
  let rowMax = 0;
  for (let j = 0; j < Tk; j++) rowMax = Math.max(rowMax, at(layer, head, tok, j));
  root.appendChild(el("div", "lbl", "layer " + d.layers[layer] + ", head " + d.heads[head] +
    ": where \u201c" + d.queries[tok] + "\u201d (position " + (q0 + tok) + ") looks; colour = weight / row max " + rowMax.toFixed(3)));
  const ks = el("div", "strip"); ks.id = "keys";
  d.keys.forEach((t, j) => {
    const w = at(layer, head, tok, j), s = el("span", "tok", t);
    s.dataset.k = String(j);
    s.dataset.w = w.toFixed(6);
    s.title = "position " + (k0 + j) + ": " + w.toFixed(4);
    if (!allowed(tok, j)) s.classList.add("masked");
    else { const v = rowMax > 0 ? w / rowMax : 0; s.style.background = color(v); s.style.color = v > 0.6 ? "#000" : "#fff"; }
    ks.appendChild(s);
  });
  root.appendChild(ks);
  const cell = Math.max(3, Math.min(16, Math.floor(900 / Math.max(Tk, 1))));
  function canvas(rows, id, value, onpick, mark) {
    const c = el("canvas"); c.id = id; c.width = Tk * cell; c.height = rows * cell;
    const g = c.getContext("2d");
    for (let r = 0; r < rows; r++) for (let j = 0; j < Tk; j++) {
      const v = value(r, j);
      g.fillStyle = v === null ? "#d0d0d0" : color(v);
      g.fillRect(j * cell, r * cell, cell, cell);
    }
    if (mark !== null) { g.strokeStyle = "#d00"; g.lineWidth = 2; g.strokeRect(1, mark * cell + 1, Tk * cell - 2, cell - 2); }
    c.addEventListener("click", e => onpick(Math.floor(e.offsetY / cell)));
    return c;
  }
  root.appendChild(el("div", "lbl", "every head for this token (rows: heads; click one to choose it)"));
  let hmax = 0;
  for (let h = 0; h < H; h++) for (let j = 0; j < Tk; j++) hmax = Math.max(hmax, at(layer, h, tok, j));
  root.appendChild(canvas(H, "heads", (h, j) => allowed(tok, j) ? at(layer, h, tok, j) / (hmax || 1) : null,
    h => set({head: clamp(h, H)}), head));
  root.appendChild(el("div", "lbl", "the whole map of this head (rows: queries, columns: keys; click a row)"));
  let mmax = 0;
  for (let i = 0; i < Tq; i++) for (let j = 0; j < Tk; j++) mmax = Math.max(mmax, at(layer, head, i, j));
  root.appendChild(canvas(Tq, "map", (i, j) => allowed(i, j) ? at(layer, head, i, j) / (mmax || 1) : null,
    i => set({token: clamp(i, Tq)}), tok));
};
