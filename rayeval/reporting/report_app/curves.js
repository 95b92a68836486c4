  // --- curves --------------------------------------------------------------------------
  var COLOURS = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e', '#17becf', '#8c564b',
                 '#e377c2', '#7f7f7f', '#bcbd22'];
  function curvesView(main, r) {
    var b = S.board;
    var bar = el('div', { 'class': 'controls' });
    bar.appendChild(el('label', null, ['Panels ', el('input', {
      type: 'search', name: 'metric', placeholder: 'Filter panels (*/acc)', value: r.metric || '',
      on: { change: function (e) { setParam('metric', e.target.value); } } })]));
    bar.appendChild(select('scale', 'Steps', [['', 'linear'], ['log', 'log']], r.scale || ''));
    var refs = VIEWS ? Object.keys(VIEWS).filter(function (k) { return /^paired\?ref=/.test(k); })
      .map(function (k) { return +k.split('=')[1]; }) : b.entries.map(function (e, i) { return i; });
    bar.appendChild(select('ref', 'Difference to', [['', 'none: the values']].concat(refs.map(function (i) {
      return [String(i), entryLabel(i)];
    })), r.ref || ''));
    main.appendChild(bar);
    var sweeps = S.meta.sweeps;
    var legend = el('div', { 'class': 'legend' }, sweeps.map(function (s, k) {
      return el('span', { style: '--c:' + COLOURS[k % COLOURS.length], text: s });
    }));
    main.appendChild(legend);
    var cols = shownColumns(r).slice(0, 60);
    var ref = r.ref === undefined || r.ref === '' ? null : +r.ref;
    var ready = marked(cols).then(function () { return ref === null ? null : get(pairedOf(ref, cols.map(function (i) { return b.columns[i].name; }))); });
    return ready.then(function (paired) {
      if (ref !== null && !paired) {
        main.appendChild(el('p', { 'class': 'error', text: 'This file holds no differences to that checkpoint; rayeval view STORE computes any.' }));
        return;
      }
      if (ref !== null) main.appendChild(el('p', { 'class': 'note', text: 'Each checkpoint minus ' + entryLabel(ref) +
        ', with the ' + pct(S.meta.level) + ' paired bootstrap interval of the difference (the same resamples for both).' }));
      var grid = el('div', { 'class': 'panels' });
      cols.forEach(function (i) { grid.appendChild(panel(b.columns[i], r.scale === 'log', paired, ref)); });
      main.appendChild(grid);
      if (shownColumns(r).length > cols.length) main.appendChild(el('p', { 'class': 'note', text: 'The first 60 panels; filter to see others.' }));
    });
  }

  function panel(c, logx, paired, ref) {
    var b = S.board, W = 340, H = 210, L = 52, R = 10, T = 22, B = 30;
    var useStep = b.entries.some(function (e) { return e.step !== null; });
    var xs = function (e) { return useStep ? e.step : e.epoch; };
    var pts = [];
    b.entries.forEach(function (e, i) {
      var x = xs(e);
      if (x === null || x === undefined || (logx && x <= 0)) return;
      if (paired) {
        var d = paired.columns[c.name] && paired.columns[c.name][i];
        if (!d) return;
        pts.push({ i: i, x: x, y: d[0], lo: d[1], hi: d[2], sweep: e.sweep });
      } else {
        if (c.values[i] === null) return;
        pts.push({ i: i, x: x, y: c.values[i], lo: c.low[i], hi: c.high[i], sweep: e.sweep });
      }
    });
    var box = el('div', { 'class': 'panel', 'data-col': c.name });
    box.appendChild(el('h3', { text: c.name + (paired ? ' (difference)' : '') + ' ' + (c.higher ? '\u2191' : '\u2193') }));
    if (!pts.length) { box.appendChild(el('p', { 'class': 'muted', text: 'no checkpoint with a step' })); return box; }
    var fx = function (x) { return logx ? Math.log10(x) : x; };
    var x0 = Math.min.apply(null, pts.map(function (p) { return fx(p.x); }));
    var x1 = Math.max.apply(null, pts.map(function (p) { return fx(p.x); }));
    var ys = [];
    pts.forEach(function (p) { ys.push(p.y); if (p.lo !== null) ys.push(p.lo); if (p.hi !== null) ys.push(p.hi); });
    var chance = paired ? 0 : c.chance;
    if (chance !== null && chance !== undefined) ys.push(chance);
    var y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
    if (x1 - x0 < 1e-12) { x0 -= 1; x1 += 1; }
    if (y1 - y0 < 1e-12) { y0 -= 0.5; y1 += 0.5; }
    var pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
    var X = function (x) { return L + (fx(x) - x0) / (x1 - x0) * (W - L - R); };
    var Y = function (y) { return T + (1 - (y - y0) / (y1 - y0)) * (H - T - B); };
    var NS = 'http://www.w3.org/2000/svg';
    var svg = document.createElementNS(NS, 'svg');
    svg.setAttribute('viewBox', '0 0 ' + W + ' ' + H);
    svg.setAttribute('role', 'img');
    function s(tag, attrs, text) {
      var n = document.createElementNS(NS, tag);
      Object.keys(attrs).forEach(function (k) { n.setAttribute(k, attrs[k]); });
      if (text !== undefined) n.textContent = text;
      svg.appendChild(n);
      return n;
    }
    s('line', { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: '#999' });
    s('line', { x1: L, y1: T, x2: L, y2: H - B, stroke: '#999' });
    ticks(y0, y1, 4).forEach(function (t) {
      s('line', { x1: L - 3, y1: Y(t), x2: W - R, y2: Y(t), stroke: '#eee' });
      s('text', { x: L - 5, y: Y(t) + 4, 'text-anchor': 'end', 'font-size': 10, fill: '#555' }, short(t));
    });
    (logx ? logTicks(x0, x1) : ticks(x0, x1, 4)).forEach(function (t) {
      var xv = logx ? t : t;
      if (logx ? (Math.log10(xv) < x0 - 1e-9 || Math.log10(xv) > x1 + 1e-9) : false) return;
      s('text', { x: X(xv), y: H - B + 14, 'text-anchor': 'middle', 'font-size': 10, fill: '#555' }, short(xv));
    });
    s('text', { x: (L + W - R) / 2, y: H - 3, 'text-anchor': 'middle', 'font-size': 10, fill: '#555' },
      (useStep ? 'training step' : 'epoch') + (logx ? ' (log)' : ''));
    if (chance !== null && chance !== undefined) {
      s('line', { x1: L, y1: Y(chance), x2: W - R, y2: Y(chance), stroke: '#888', 'stroke-dasharray': '4 3' });
      s('text', { x: W - R - 2, y: Y(chance) - 3, 'text-anchor': 'end', 'font-size': 10, fill: '#666' },
        paired ? 'no difference' : (c.metric === 'accuracy' ? 'majority answer' : 'chance'));
    }
    var best = null;
    S.meta.sweeps.forEach(function (sw, k) {
      var mine = pts.filter(function (p) { return p.sweep === sw; }).sort(function (a, b) { return a.x - b.x; });
      if (!mine.length) return;
      var colour = COLOURS[k % COLOURS.length];
      var band = mine.filter(function (p) { return p.lo !== null && p.hi !== null; });
      if (band.length > 1) {
        var up = band.map(function (p) { return X(p.x) + ',' + Y(p.hi); });
        var down = band.slice().reverse().map(function (p) { return X(p.x) + ',' + Y(p.lo); });
        s('polygon', { points: up.concat(down).join(' '), fill: colour, 'fill-opacity': 0.18, stroke: 'none' });
      } else band.forEach(function (p) {
        s('line', { x1: X(p.x), y1: Y(p.lo), x2: X(p.x), y2: Y(p.hi), stroke: colour, 'stroke-opacity': 0.5, 'stroke-width': 3 });
      });
      s('polyline', { points: mine.map(function (p) { return X(p.x) + ',' + Y(p.y); }).join(' '),
                      fill: 'none', stroke: colour, 'stroke-width': 1.6 });
      mine.forEach(function (p) {
        var dot = s('circle', { cx: X(p.x), cy: Y(p.y), r: 2.5, fill: colour });
        var t = document.createElementNS(NS, 'title');
        t.textContent = entryLabel(p.i) + ': ' + fmt(p.y) + (p.lo !== null ? ' [' + fmt(p.lo) + ', ' + fmt(p.hi) + ']' : '');
        dot.appendChild(t);
      });
    });
    if (!paired && c.marks) pts.forEach(function (p) { if (c.marks.charAt(p.i) === '*') best = p; });
    if (best) {
      s('circle', { cx: X(best.x), cy: Y(best.y), r: 6, fill: 'none', stroke: '#137333', 'stroke-width': 2, 'class': 'best' });
      s('text', { x: X(best.x), y: Y(best.y) - 9, 'text-anchor': 'middle', 'font-size': 10, fill: '#137333' }, 'best');
    }
    box.appendChild(svg);
    return box;
  }
  function ticks(a, b, n) {
    var step = Math.pow(10, Math.floor(Math.log10((b - a) / n)));
    var err = (b - a) / n / step;
    step *= err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1;
    var out = [];
    for (var t = Math.ceil(a / step) * step; t <= b + step * 1e-9; t += step) out.push(+t.toPrecision(12));
    return out;
  }
  function logTicks(a, b) {
    var out = [];
    for (var k = Math.floor(a); k <= Math.ceil(b); k++) out.push(Math.pow(10, k));
    return out;
  }
  function short(v) {
    var a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toPrecision(3) + 'M';
    if (a >= 1e4) return (v / 1e3).toPrecision(3) + 'k';
    return a >= 100 || v === Math.round(v) ? String(Math.round(v * 100) / 100) : String(Number(v.toPrecision(3)));
  }
