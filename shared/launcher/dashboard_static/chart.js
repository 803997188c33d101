// Line charts and a slot timeline on a canvas, for the Chorus dashboard. No dependencies.
"use strict";

const ChorusChart = (() => {
  const PAD = { l: 48, r: 10, t: 20, b: 24 };

  function niceStep(span, n) {
    const raw = span / Math.max(1, n);
    const p = Math.pow(10, Math.floor(Math.log10(raw || 1)));
    const f = raw / p;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
  }

  function fmt(v) {
    if (!isFinite(v)) return "";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(1);
    return String(Math.round(v * 1000) / 1000);
  }

  function clock(s) {
    s = Math.max(0, Math.round(s));
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    return (h ? h + ":" + String(m).padStart(2, "0") : m) + ":" + String(sec).padStart(2, "0");
  }

  class Line {
    // opts: {xLabel, yLabel, time (x in seconds from opts.t0()), yMin, yMax, onClick(x)}
    constructor(canvas, opts) {
      this.canvas = canvas;
      this.opts = opts || {};
      this.series = [];
      this.dirty = true;
      this.hover = null;
      canvas.addEventListener("mousemove", (e) => this.move(e));
      canvas.addEventListener("mouseleave", () => { this.hover = null; this.tip(null); });
      canvas.addEventListener("click", (e) => {
        const hit = this.nearest(e);
        if (hit && this.opts.onClick) this.opts.onClick(hit.p[0], hit.s);
      });
    }

    set(series) { this.series = series; this.dirty = true; }

    // A cleared canvas at the device's pixel ratio: its context and CSS size; null when nothing changed.
    begin() {
      if (!this.dirty) return null;
      this.dirty = false;
      const c = this.canvas, dpr = window.devicePixelRatio || 1;
      const w = c.clientWidth, h = c.clientHeight;
      if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
        c.width = Math.round(w * dpr); c.height = Math.round(h * dpr);
      }
      const g = c.getContext("2d");
      g.setTransform(dpr, 0, 0, dpr, 0, 0);
      g.clearRect(0, 0, w, h);
      g.font = "11px system-ui, sans-serif";
      return { g, w, h };
    }

    bounds() {
      let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
      for (const s of this.series) for (const [x, y] of s.points) {
        if (y === null || y === undefined || !isFinite(y)) continue;
        x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
      }
      if (!isFinite(x0)) return null;
      if (this.opts.yMin !== undefined) y0 = Math.min(y0, this.opts.yMin);
      if (this.opts.yMax !== undefined) y1 = Math.max(y1, this.opts.yMax);
      if (x1 === x0) { x1 = x0 + 1; }
      if (y1 === y0) { y1 = y0 + 1; y0 = y0 - (y0 === 0 ? 0 : 1); }
      const pad = (y1 - y0) * 0.05;
      return { x0, x1, y0: y0 - (this.opts.yMin === 0 && y0 >= 0 ? 0 : pad), y1: y1 + pad };
    }

    draw() {
      const frame = this.begin();
      if (!frame) return;
      const { g, w, h } = frame;
      const b = this.bounds();
      this.b = b; this.w = w; this.h = h;
      if (!b) {
        g.fillStyle = "#8a8f99";
        g.fillText(this.opts.empty || "no data yet", PAD.l, h / 2);
        return;
      }
      const X = (x) => PAD.l + (x - b.x0) / (b.x1 - b.x0) * (w - PAD.l - PAD.r);
      const Y = (y) => h - PAD.b - (y - b.y0) / (b.y1 - b.y0) * (h - PAD.t - PAD.b);
      this.X = X; this.Y = Y;
      // grid and ticks
      g.strokeStyle = "#eceff3"; g.fillStyle = "#6b7385"; g.lineWidth = 1;
      const ys = niceStep(b.y1 - b.y0, 4);
      for (let y = Math.ceil(b.y0 / ys) * ys; y <= b.y1; y += ys) {
        g.beginPath(); g.moveTo(PAD.l, Y(y)); g.lineTo(w - PAD.r, Y(y)); g.stroke();
        g.fillText(fmt(y), 4, Y(y) + 4);
      }
      const xs = niceStep(b.x1 - b.x0, Math.max(2, Math.floor((w - PAD.l) / 90)));
      for (let x = Math.ceil(b.x0 / xs) * xs; x <= b.x1; x += xs) {
        g.beginPath(); g.moveTo(X(x), PAD.t); g.lineTo(X(x), h - PAD.b); g.stroke();
        const label = this.opts.time ? clock(x) : fmt(x);
        g.fillText(label, X(x) - g.measureText(label).width / 2, h - 8);
      }
      g.fillText(this.opts.time ? "time (m:s)" : (this.opts.xLabel || "version"), w - PAD.r - 70, h - PAD.b - 4);
      // series
      for (const s of this.series) {
        g.strokeStyle = s.color; g.fillStyle = s.color; g.lineWidth = s.width || 1.6;
        g.setLineDash(s.dashed ? [5, 4] : []);
        g.beginPath();
        let started = false;
        for (const [x, y] of s.points) {
          if (y === null || y === undefined || !isFinite(y)) { started = false; continue; }
          if (!started) { g.moveTo(X(x), Y(y)); started = true; } else g.lineTo(X(x), Y(y));
        }
        g.stroke();
        g.setLineDash([]);
        if (s.markers || s.points.length < 3) for (const [x, y] of s.points) {
          if (y === null || y === undefined || !isFinite(y)) continue;
          g.beginPath(); g.arc(X(x), Y(y), 3, 0, 2 * Math.PI); g.fill();
        }
      }
      // legend
      let lx = PAD.l + 4;
      for (const s of this.series) {
        if (s.legend === false) continue;
        g.fillStyle = s.color; g.fillRect(lx, 5, 10, 3);
        g.fillStyle = "#1d2330"; g.fillText(s.name, lx + 13, 11);
        lx += 22 + g.measureText(s.name).width;
      }
      if (this.hover) {
        const [x, y] = this.hover.p;
        g.strokeStyle = "#1d2330"; g.lineWidth = 1;
        g.beginPath(); g.arc(X(x), Y(y), 5, 0, 2 * Math.PI); g.stroke();
      }
    }

    nearest(e) {
      if (!this.b) return null;
      const r = this.canvas.getBoundingClientRect();
      const mx = e.clientX - r.left, my = e.clientY - r.top;
      let best = null, bd = 400;
      for (const s of this.series) for (const p of s.points) {
        if (p[1] === null || p[1] === undefined || !isFinite(p[1])) continue;
        const d = Math.pow(this.X(p[0]) - mx, 2) + Math.pow(this.Y(p[1]) - my, 2);
        if (d < bd) { bd = d; best = { s, p }; }
      }
      return best;
    }

    move(e) {
      const hit = this.nearest(e);
      this.hover = hit; this.dirty = true;
      if (!hit) { this.tip(null); return; }
      const x = this.opts.time ? clock(hit.p[0]) : fmt(hit.p[0]);
      this.tip(`${hit.s.name}\n${this.opts.time ? "time" : (this.opts.xLabel || "version")} ${x}: ${fmt(hit.p[1])}`
        + (this.opts.onClick ? "\nclick: its episodes" : ""), e.clientX, e.clientY);
    }

    tip(text, x, y) {
      const el = document.getElementById("tip");
      if (!el) return;
      if (!text) { el.hidden = true; return; }
      el.textContent = text; el.hidden = false;
      el.style.left = (x + 12) + "px"; el.style.top = (y + 12) + "px";
    }
  }

  // Rows = slots, coloured segments = the model holding the slot over time.
  class Timeline extends Line {
    set(rows) { this.rows = rows; this.dirty = true; }

    draw() {
      const frame = this.begin();
      if (!frame) return;
      const { g, w, h } = frame;
      const rows = this.rows || { slots: [], t0: 0, t1: 1, colors: {} };
      if (!rows.slots.length) { g.fillStyle = "#8a8f99"; g.fillText("no training pool", PAD.l, h / 2); return; }
      const X = (t) => PAD.l + (t - rows.t0) / Math.max(1e-9, rows.t1 - rows.t0) * (w - PAD.l - PAD.r);
      const band = (h - PAD.t - PAD.b) / rows.slots.length;
      rows.slots.forEach((segs, i) => {
        const y = PAD.t + i * band;
        g.fillStyle = "#6b7385"; g.fillText("slot " + i, 4, y + band / 2 + 4);
        for (const [a, b, holder] of segs) {
          g.fillStyle = holder ? (rows.colors[holder] || "#888") : "#eceff3";
          g.fillRect(X(a), y + 2, Math.max(1, X(b) - X(a)), band - 4);
        }
      });
      const xs = niceStep(rows.t1 - rows.t0, 5);
      g.fillStyle = "#6b7385";
      for (let t = Math.ceil(rows.t0 / xs) * xs; t <= rows.t1; t += xs) g.fillText(clock(t), X(t) - 12, h - 8);
      let lx = PAD.l + 4;
      for (const [name, color] of Object.entries(rows.colors)) {
        g.fillStyle = color; g.fillRect(lx, 5, 10, 6);
        g.fillStyle = "#1d2330"; g.fillText(name, lx + 13, 11);
        lx += 22 + g.measureText(name).width;
      }
    }

    nearest() { return null; }
  }

  return { Line, Timeline, fmt, clock };
})();
