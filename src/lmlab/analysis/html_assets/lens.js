LM.render.lens = function (root, p, st, set) {
  // d.top (R, T, k) indices into d.vocab; d.probs packed (R, T, k); rows bottom-up: embed first
  const d = p.data, R = d.rows.length, T = d.tokens.length, K = d.top.length ? d.top[0][0].length : 0;
  if (!d._p) d._p = unpack(d.probs);
  if (d.target && !d.target._p) d.target._p = unpack(d.target.probs);
  const clamp = (v, n) => Math.max(0, Math.min(n - 1, Number.isFinite(+v) ? Math.floor(+v) : 0));
  const row = clamp(st.row === undefined ? R - 1 : st.row, R), tok = clamp(st.token === undefined ? T - 1 : st.token, T);
  const prob = (r, t, k) => d._p[(r * T + t) * K + k];
  if (d.source) root.appendChild(el("div", "lbl", "source (the encoder's input): " + d.source.join(" ")));
  root.appendChild(el("div", "lbl", "rows: the residual stream after each layer (embed at the bottom); " +
    "columns: input tokens, each predicting the next; colour = top-1 probability; hover or click a cell"));
  const wrap = el("div"); wrap.style.overflowX = "auto";
  const grid = el("table"); grid.id = "grid"; grid.style.borderCollapse = "collapse";
  const w = T > 40 ? 34 : 62, STICKY = "position:sticky;left:0;background:#fff;";  // row names stay in view
  for (let r = R - 1; r >= 0; r--) {
    const tr = el("tr");
    const th = el("th", "", d.rows[r]); th.style.cssText = STICKY + "font-size:11px;text-align:right;padding-right:4px;white-space:nowrap";
    tr.appendChild(th);
    for (let t = 0; t < T; t++) {
      const v = prob(r, t, 0), c = el("td", "cell", d.vocab[d.top[r][t][0]]);
      c.dataset.r = String(r); c.dataset.t = String(t);
      c.title = d.rows[r] + ", position " + t + ": " + v.toFixed(3);
      c.style.cssText = "min-width:" + w + "px;max-width:" + w + "px;overflow:hidden;font-size:" + (T > 40 ? 9 : 11) +
        "px;white-space:pre;cursor:pointer;padding:2px;border:1px solid #fff;text-align:center;" +
        "font-family:'Noto Sans CJK SC','WenQuanYi Zen Hei',monospace";
      c.style.background = color(v); c.style.color = v > 0.6 ? "#000" : "#fff";
      if (r === row && t === tok) c.style.outline = "2px solid #d00";
      const pick = () => { d._scroll = wrap.scrollLeft; set({row: r, token: t}); };
      c.addEventListener("mouseenter", () => { if (r !== row || t !== tok) pick(); });
      c.addEventListener("click", pick);
      tr.appendChild(c);
    }
    grid.appendChild(tr);
  }
  const foot = el("tr"), corner = el("th"); corner.style.cssText = STICKY; foot.appendChild(corner);
  d.tokens.forEach((s, t) => {
    const c = el("td", "tok" + (t === tok ? " sel" : ""), s);
    c.dataset.q = String(t); c.title = "position " + t;
    c.style.cssText = "font-size:10px;text-align:center;max-width:" + w + "px;overflow:hidden";
    if (t % 10 === 0) c.appendChild(el("sub", "", String(t)));
    foot.appendChild(c);
  });
  grid.appendChild(foot);
  wrap.appendChild(grid);
  root.appendChild(wrap);
  wrap.scrollLeft = d._scroll || 0;  // a redraw keeps the grid where the reader scrolled it
  root.appendChild(el("div", "lbl", d.rows[row] + ", position " + tok + " (\u201c" + d.tokens[tok] +
    "\u201d): the " + K + " most likely next tokens"));
  const list = el("table"); list.id = "topk";
  for (let k = 0; k < K; k++) {
    const tr = el("tr"), v = prob(row, tok, k);
    tr.dataset.p = v.toFixed(6);
    const name = el("td", "tok", d.vocab[d.top[row][tok][k]]);
    const bar = el("td"), fill = el("div");
    fill.style.cssText = "height:10px;background:#3b528b;width:" + Math.round(200 * v) + "px";
    bar.appendChild(fill);
    tr.appendChild(name); tr.appendChild(el("td", "", v.toFixed(4))); tr.appendChild(bar);
    list.appendChild(tr);
  }
  root.appendChild(list);
  if (d.target) {
    const i = row * T + tok;
    const line = el("div", "lbl", "target \u201c" + d.target.label + "\u201d here: probability " +
      d.target._p[i].toFixed(4) + ", rank " + d.target.ranks[row][tok]);
    line.id = "target";
    root.appendChild(line);
  }
};
