LM.render.heads = function (root, p, st, set) {
  // p.data: detectors[], titles[], layers[], heads[], scores {detector: [layer][head]},
  // kinds [layer][head] ("induction,sink"), thresholds {detector: t}. State: detector index.
  const d = p.data, D = d.detectors.length, L = d.layers.length, H = d.heads.length;
  const clamp = (v, n) => Math.max(0, Math.min(n - 1, Number.isFinite(+v) ? Math.floor(+v) : 0));
  const det = clamp(st.detector, D), name = d.detectors[det];
  const ctl = el("div", "ctl");
  ctl.appendChild(select("detector", d.titles, det, v => set({detector: v})));
  root.appendChild(ctl);
  root.appendChild(el("div", "lbl", d.titles[det] + ": mean attention on the predicted key; " +
    "outlined cells reach the threshold " + d.thresholds[name] + " (rows: layers, columns: heads)"));
  const info = el("div", "lbl", "hover a cell to see all four scores");
  info.id = "hover";
  const table = el("table");
  table.id = "grid";
  table.style.borderCollapse = "collapse";
  const top = el("tr");
  top.appendChild(el("th", "", ""));
  d.heads.forEach(h => top.appendChild(el("th", "", "H" + h)));
  table.appendChild(top);
  d.layers.forEach((layer, li) => {
    const tr = el("tr");
    tr.appendChild(el("th", "", "L" + layer));
    d.heads.forEach((head, hi) => {
      const v = d.scores[name][li][hi], td = el("td", "cell", v.toFixed(2));
      td.dataset.layer = String(layer);
      td.dataset.head = String(head);
      td.dataset.v = v.toFixed(6);
      td.style.background = color(v);
      td.style.color = v > 0.6 ? "#000" : "#fff";
      td.style.padding = "2px 5px";
      td.style.font = "11px monospace";
      if (v >= d.thresholds[name]) td.style.outline = "2px solid #d00";
      td.addEventListener("mouseenter", () => {
        const parts = d.detectors.map(k => k + " " + d.scores[k][li][hi].toFixed(3));
        const kinds = d.kinds[li][hi];
        info.textContent = "layer " + layer + ", head " + head + ": " + parts.join(", ") +
          (kinds ? " (" + kinds + ")" : "");
      });
      tr.appendChild(td);
    });
    table.appendChild(tr);
  });
  root.appendChild(info);
  root.appendChild(table);
};
