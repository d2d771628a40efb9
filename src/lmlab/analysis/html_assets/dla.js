LM.render.dla = function (root, p, st, set) {
  // d.heads (L, H) logits; d.ffn (L,); d.attn_bias (L,) or null; d.top [[name, value]];
  // d.head_labels: the heads' column names (an encoder-decoder: self H0.., cross H0.., biases)
  const d = p.data, L = d.heads.length, H = L ? d.heads[0].length : 0;
  root.appendChild(el("div", "lbl", "contributions to " + d.what + " at position " + d.position +
    " (\u201c" + d.token + "\u201d), in logits; the final norm frozen at this run's scale"));
  let m = 0;
  const cols = r => d.heads[r].concat([d.ffn[r]], d.attn_bias ? [d.attn_bias[r]] : []);
  for (let r = 0; r < L; r++) for (const v of cols(r)) m = Math.max(m, Math.abs(v));
  const tint = v => {  // red positive, blue negative
    const a = m > 0 ? Math.min(1, Math.abs(v) / m) : 0, c = Math.round(255 * (1 - a));
    return v >= 0 ? "rgb(255," + c + "," + c + ")" : "rgb(" + c + "," + c + ",255)";
  };
  const table = el("table"); table.id = "dla-grid"; table.style.borderCollapse = "collapse";
  const head = el("tr"); head.appendChild(el("th"));
  for (let h = 0; h < H; h++) head.appendChild(el("th", "", d.head_labels ? d.head_labels[h] : "H" + h));
  head.appendChild(el("th", "", "FFN"));
  if (d.attn_bias) head.appendChild(el("th", "", "bias"));
  table.appendChild(head);
  for (let r = L - 1; r >= 0; r--) {
    const tr = el("tr"); tr.appendChild(el("th", "", "layer " + r));
    cols(r).forEach(v => {
      const c = el("td", "", v.toFixed(3));
      c.style.cssText = "padding:2px 6px;font-size:11px;text-align:right;border:1px solid #eee";
      c.style.background = tint(v);
      tr.appendChild(c);
    });
    table.appendChild(tr);
  }
  root.appendChild(table);
  root.appendChild(el("div", "lbl", "other terms: " + d.others.map(o => o[0] + " " + o[1].toFixed(4)).join(", ")));
  root.appendChild(el("div", "lbl", "largest components by |contribution|"));
  const top = el("table"); top.id = "dla-top";
  d.top.forEach(([n, v]) => {
    const tr = el("tr");
    tr.appendChild(el("td", "", n)); tr.appendChild(el("td", "", (v >= 0 ? "+" : "") + v.toFixed(4)));
    top.appendChild(tr);
  });
  root.appendChild(top);
  const sum = el("div", "lbl", "sum of all components " + d.total.toFixed(4) + "; actual " + d.actual.toFixed(4));
  sum.id = "dla-sum";
  root.appendChild(sum);
};
