/* rayeval report: the board, curves over training, items and A against B.
 * One app for the file `rayeval report` writes (its views embedded in #rayeval-views) and
 * the page `rayeval view` serves (views fetched from api/NAME?QUERY). It never computes an
 * interval: every interval shown is the store's or rayeval's (paired, exact). It counts
 * items and runs McNemar's exact test on those counts. Every text from the store goes in
 * through textContent, never as markup. */
(function () {
  'use strict';
  var EMBEDDED = document.getElementById('rayeval-views');
  var VIEWS = EMBEDDED ? JSON.parse(EMBEDDED.textContent) : null;
  var PAGE = 100;        // board rows and items per page: a 14,000-item list paints 100
  var cache = {};
  var S = { meta: null, board: null, route: {}, order: null };

  // --- data ----------------------------------------------------------------------------
  function get(path) {
    if (path in cache) return cache[path];
    var p;
    if (VIEWS) {
      p = Promise.resolve(path in VIEWS ? VIEWS[path] : null);
    } else {
      p = fetch('api/' + path).then(function (r) {
        return r.json().then(function (body) {
          if (!r.ok) throw new Error(body.error || r.statusText);
          return body;
        });
      });
    }
    cache[path] = p;
    return p;
  }
  function pairedOf(ref, names) {
    // a file holds every column's differences to a reference; rayeval view computes those of
    // the columns shown (all 300 of a 100,000-cell store took 16 s)
    return q('paired', VIEWS || !names ? { ref: ref } : { ref: ref, columns: names.join(',') });
  }

  function q(name, params) {
    var parts = Object.keys(params).map(function (k) {
      return k + '=' + (VIEWS ? params[k] : encodeURIComponent(params[k]));
    });
    return name + (parts.length ? '?' + parts.join('&') : '');
  }

  // --- small DOM helpers ---------------------------------------------------------------
  function el(tag, attrs, children) {
    var n = document.createElement(tag);
    if (attrs) Object.keys(attrs).forEach(function (k) {
      var v = attrs[k];
      if (v === null || v === undefined || v === false) return;
      if (k === 'text') n.textContent = v;
      else if (k === 'on') Object.keys(v).forEach(function (e) { n.addEventListener(e, v[e]); });
      else if (k === 'style') n.setAttribute('style', v);
      else n.setAttribute(k, v === true ? '' : v);
    });
    (children || []).forEach(function (c) {
      if (c === null || c === undefined) return;
      n.appendChild(typeof c === 'string' ? document.createTextNode(c) : c);
    });
    return n;
  }
  function clear(n) { while (n.firstChild) n.removeChild(n.firstChild); return n; }
  function fmt(v, digits) {
    if (v === null || v === undefined || (typeof v === 'number' && isNaN(v))) return '-';
    return Number(v).toFixed(digits === undefined ? 4 : digits);
  }
  function pct(level) { return level ? Math.round(level * 1000) / 10 + '%' : ''; }
  function glob(pattern) {
    var re = pattern.replace(/[.+^${}()|[\]\\]/g, '\\$&').replace(/\*/g, '.*').replace(/\?/g, '.');
    return new RegExp(pattern.indexOf('*') < 0 && pattern.indexOf('?') < 0 ? re : '^' + re + '$', 'i');
  }
  function go(view, params) {
    var parts = Object.keys(params || {}).filter(function (k) {
      return params[k] !== '' && params[k] !== null && params[k] !== undefined;
    }).map(function (k) { return k + '=' + encodeURIComponent(params[k]); });
    location.hash = '#' + view + (parts.length ? '?' + parts.join('&') : '');
  }
  function route() {
    var h = location.hash.replace(/^#/, '');
    var i = h.indexOf('?');
    var r = { view: (i < 0 ? h : h.slice(0, i)) || 'board' };
    if (i >= 0) h.slice(i + 1).split('&').forEach(function (kv) {
      var j = kv.indexOf('=');
      if (j > 0) r[kv.slice(0, j)] = decodeURIComponent(kv.slice(j + 1));
    });
    return r;
  }
  function setParam(k, v) { var r = route(); r[k] = v; var view = r.view; delete r.view; go(view, r); }
  function entryLabel(i) {
    var e = S.board.entries[i];
    var several = S.meta.sweeps.length > 1;
    return (several ? e.sweep + ' / ' : '') + e.name + (e.step !== null ? ' (step ' + e.step + ')' : '');
  }

  // --- the frame -----------------------------------------------------------------------
  var VIEWS_SHOWN = [['board', 'Board'], ['curves', 'Curves'], ['items', 'Items'],
                     ['compare', 'A vs B'], ['about', 'Provenance']];
  function frame() {
    var title = document.getElementById('title');
    var nav = clear(document.getElementById('nav'));
    var r = route();
    VIEWS_SHOWN.forEach(function (v) {
      nav.appendChild(el('a', { href: '#' + v[0], 'class': r.view === v[0] ? 'on' : null,
                                text: v[1] }));
    });
    var m = S.meta;
    title.textContent = 'rayeval: ' + m.sweeps.join(', ') +
      (m.filters.evaluation ? ' on ' + m.filters.evaluation : '');
    document.title = title.textContent;
    var sub = clear(document.getElementById('subtitle'));
    sub.appendChild(document.createTextNode(
      m.checkpoints + ' checkpoint(s), ' + m.evaluations.length + ' evaluation(s), ' +
      m.cells + ' cell(s); intervals: ' + pct(m.level) + ' bootstrap; store ' + m.store));
  }

  function render() {
    var r = route();
    S.route = r;
    frame();
    // each render draws into its own container: a view that finishes after the reader moved
    // on draws into a node no longer in the page
    var main = el('div', { 'class': 'view' });
    clear(document.getElementById('main')).appendChild(main);
    var view = { board: boardView, curves: curvesView, items: itemsView, compare: compareView,
                 about: aboutView, entry: entryView, item: itemPage }[r.view] || boardView;
    var hash = location.hash;
    document.body.removeAttribute('data-rendered');
    var done = function () {
      if (location.hash !== hash) return;
      document.body.setAttribute('data-rendered', hash || '#');
      document.body.setAttribute('data-ready', '1');        // the first view is drawn
    };
    var fail = function (e) { main.appendChild(el('p', { 'class': 'error', text: String(e.message || e) })); done(); };
    try {
      Promise.resolve(view(main, r)).then(done, fail);
    } catch (e) {
      fail(e);
    }
  }

  // --- the board -----------------------------------------------------------------------
  function shownColumns(r) {
    var cols = S.board.columns.map(function (c, i) { return i; });
    if (r.evaluation) cols = cols.filter(function (i) {
      var c = S.board.columns[i]; return c.evaluation === r.evaluation || c.evaluation === '*';
    });
    if (r.metric) {
      var re = glob(r.metric);
      cols = cols.filter(function (i) { return re.test(S.board.columns[i].name); });
    }
    return cols;
  }
  function shownEntries(r) {
    var rows = S.board.entries.map(function (e, i) { return i; });
    if (r.sweep) rows = rows.filter(function (i) { return S.board.entries[i].sweep === r.sweep; });
    if (r.checkpoint) {
      var re = glob(r.checkpoint);
      rows = rows.filter(function (i) { return re.test(S.board.entries[i].checkpoint); });
    }
    var sort = r.sort || 'rank', dir = r.dir || '';
    var key;
    if (sort === 'rank') key = function (i) { return S.board.entries[i].rank; };
    else if (sort === 'sweep' || sort === 'checkpoint') key = function (i) { return S.board.entries[i][sort]; };
    else if (sort === 'step') key = function (i) { var s = S.board.entries[i].step; return s === null ? Infinity : s; };
    else {
      var c = S.board.columns.filter(function (x) { return x.name === sort; })[0];
      if (c) {
        var sign = c.higher ? -1 : 1;     // best first, as the rank
        key = function (i) { var v = c.values[i]; return v === null ? Infinity : sign * v; };
      } else key = function (i) { return S.board.entries[i].rank; };
    }
    rows.sort(function (a, b) {
      var x = key(a), y = key(b);
      var d = x < y ? -1 : x > y ? 1 : S.board.entries[a].rank - S.board.entries[b].rank;
      return dir === 'flip' ? -d : d;
    });
    return rows;
  }

  function boardView(main, r) {
    var b = S.board;
    var bar = el('div', { 'class': 'controls' });
    bar.appendChild(el('label', null, ['Checkpoints ', el('input', {
      type: 'search', name: 'checkpoint', placeholder: 'Filter checkpoints (glob: *step_3*)',
      value: r.checkpoint || '', on: { change: function (e) { setParam('checkpoint', e.target.value); } } })]));
    bar.appendChild(select('sweep', 'Sweep', [''].concat(S.meta.sweeps), r.sweep, 'every sweep'));
    bar.appendChild(select('evaluation', 'Evaluation', [''].concat(S.meta.evaluations.map(function (e) { return e.name; })),
                           r.evaluation, 'every evaluation'));
    bar.appendChild(el('label', null, ['Metrics ', el('input', {
      type: 'search', name: 'metric', placeholder: 'Filter metrics (*/acc)', value: r.metric || '',
      on: { change: function (e) { setParam('metric', e.target.value); } } })]));
    main.appendChild(bar);
    var cols = shownColumns(r), rows = shownEntries(r);
    var shown = pageOfColumns(main, r, cols);
    var table = boardTable(main, r, shown, rows);
    // a big store's board comes without marks: they fill in as the server computes them,
    // until the reader leaves the board
    marked(shown, function (names) { remark(table, shown, names); },
           function () { return table.isConnected; });
  }

  var COLUMN_PAGE = 60;      // columns drawn at once: 100 rows x 301 columns is 150,000 nodes
  function pageOfColumns(main, r, cols) {
    if (cols.length <= COLUMN_PAGE) return cols;
    var page = Math.min(+(r.cols || 0), Math.ceil(cols.length / COLUMN_PAGE) - 1);
    var p = el('div', { 'class': 'pager' });
    p.appendChild(el('button', { disabled: page <= 0, text: '\u2190 columns', on: { click: function () { setParam('cols', String(page - 1)); } } }));
    p.appendChild(el('span', { text: 'columns ' + (page * COLUMN_PAGE + 1) + '\u2013' + Math.min(cols.length, (page + 1) * COLUMN_PAGE) +
      ' of ' + cols.length + ' (filter by evaluation or metric to see fewer)' }));
    p.appendChild(el('button', { disabled: (page + 1) * COLUMN_PAGE >= cols.length, text: 'columns \u2192', on: { click: function () { setParam('cols', String(page + 1)); } } }));
    main.appendChild(p);
    return cols.slice(page * COLUMN_PAGE, (page + 1) * COLUMN_PAGE);
  }

  function marked(cols, then, wanted_still) {
    // the marks of columns not marked yet, asked for a few columns at a time (each needs its
    // rows' replicates read and compared); ``then(names)`` as each part arrives
    var b = S.board;
    var wanted = cols.map(function (i) { return b.columns[i].name; })
      .filter(function (n) { return b.marked.indexOf(n) < 0; });
    if (!wanted.length || VIEWS) return Promise.resolve();
    var chunks = [];
    for (var k = 0; k < wanted.length; k += 8) chunks.push(wanted.slice(k, k + 8));
    return chunks.reduce(function (prev, chunk) {
      return prev.then(function () {
        if (wanted_still && !wanted_still()) return null;
        return get(q('marks', { columns: chunk.join(',') })).then(function (m) {
          b.columns.forEach(function (c) { if (m[c.name]) { c.marks = m[c.name]; b.marked.push(c.name); } });
          if (then) then(chunk);
        });
      });
    }, Promise.resolve());
  }

  function remark(table, cols, names) {
    // redraw the cells of the newly marked columns in place
    if (!table.isConnected) return;
    var b = S.board;
    cols.forEach(function (j, k) {
      if (names.indexOf(b.columns[j].name) < 0) return;
      Array.prototype.forEach.call(table.tBodies[0].rows, function (tr) {
        var old = tr.cells[4 + k];
        tr.replaceChild(boardCell(b.columns[j], +tr.dataset.entry, old.classList.contains('first')), old);
      });
    });
  }

  function select(name, label, options, value, none, onchange) {
    var s = el('select', { name: name, on: { change: onchange || function (e) { setParam(name, e.target.value); } } });
    options.forEach(function (o) {
      var v = Array.isArray(o) ? o[0] : o, t = Array.isArray(o) ? o[1] : (o === '' ? none : o);
      s.appendChild(el('option', { value: v, selected: String(v) === String(value === undefined ? '' : value), text: t }));
    });
    return el('label', null, [label + ' ', s]);
  }

  function boardTable(main, r, cols, rows) {
    var b = S.board;
    var page = +(r.page || 0), pages = Math.max(1, Math.ceil(rows.length / PAGE));
    var shown = rows.slice(page * PAGE, page * PAGE + PAGE);
    var groups = [], last = null;
    cols.forEach(function (i) {
      var ev = b.columns[i].evaluation;
      if (last && last.ev === ev) last.span++;
      else { last = { ev: ev, span: 1 }; groups.push(last); }
    });
    var sizes = {};
    S.meta.evaluations.forEach(function (e) { sizes[e.name] = e; });
    var head1 = el('tr', null, ['rank', 'sweep', 'checkpoint', 'step'].map(function (h, k) {
      var th = sortHead(h, h, r);
      th.className += ' frozen f' + k;
      th.setAttribute('rowspan', 2);
      return th;
    }));
    groups.forEach(function (g) {
      var info = sizes[g.ev];
      var label = g.ev === '*' ? 'all' : g.ev;
      var th = el('th', { 'class': 'group', colspan: g.span }, [
        g.ev === '*' ? label : el('a', { href: '#items?evaluation=' + encodeURIComponent(g.ev), text: label }),
        info ? el('span', { 'class': 'muted', text: ' n=' + (info.rows === null ? '?' : info.rows.toLocaleString()) +
                                                        (info.tokens ? ', ' + info.tokens.toLocaleString() + ' tokens' : '') }) : null]);
      head1.appendChild(th);
    });
    var head2 = el('tr');
    var firstOf = {};
    groups.reduce(function (k, g) { firstOf[k] = true; return k + g.span; }, 0);
    cols.forEach(function (i, k) {
      var c = b.columns[i];
      var th = sortHead(c.metric + (c.higher ? ' \u2191' : ' \u2193'), c.name, r);
      th.setAttribute('data-col', c.name);
      th.setAttribute('title', c.name + ': ' + (c.higher ? 'higher' : 'lower') + ' is better' +
                      (c.averaged ? '; averaged into the aggregate' : ''));
      if (c.name === b.rank_by) th.classList.add('rank-by');
      if (firstOf[k]) th.classList.add('first');
      head2.appendChild(th);
    });
    var body = el('tbody');
    shown.forEach(function (i) {
      var e = b.entries[i];
      var tr = el('tr', { 'data-entry': i, 'data-checkpoint': e.checkpoint, 'class': e.stopped ? 'stopped' : null }, [
        el('td', { 'class': 'frozen f0', text: e.stopped ? '-' : String(e.rank) }),
        el('td', { 'class': 'frozen f1 name', text: e.sweep }),
        el('td', { 'class': 'frozen f2 name', title: e.checkpoint + (e.stopped ? ' (' + e.stopped + ')' : '') },
           [el('a', { href: '#entry?entry=' + i, text: e.name })]),
        el('td', { 'class': 'frozen f3', text: e.step === null ? '-' : String(e.step) })]);
      cols.forEach(function (j, k) { tr.appendChild(boardCell(b.columns[j], i, firstOf[k])); });
      body.appendChild(tr);
    });
    var table = el('table', { 'class': 'board' }, [el('thead', null, [head1, head2]), body]);
    var rendered = table;
    main.appendChild(el('div', { 'class': 'scroll' }, [table]));
    main.appendChild(pager(page, pages, rows.length, 'checkpoint(s)'));
    var level = pct(S.meta.level);
    main.appendChild(el('p', { 'class': 'note' }, [
      'Ranked by ' + b.rank_by + ' (' + (b.higher ? 'higher' : 'lower') + ' is better). ' +
      'Bold green: the best value of its column; amber (~): not distinguishable from it ' +
      '(the ' + level + ' paired bootstrap interval of the difference contains 0). Bars: the ' +
      level + ' bootstrap interval on the column\u2019s scale; hatched: an exact binomial ' +
      'interval, where every item scored the same (a bootstrap interval would be a point).']));
    b.notes.forEach(function (n) {
      main.appendChild(el('p', { 'class': 'note' + (/^warning/.test(n) ? ' warning' : ''), text: n }));
    });
    return rendered;
  }

  function sortHead(text, key, r) {
    var active = (r.sort || 'rank') === key;
    var th = el('th', { 'class': 'sortable', 'data-sort': key, tabindex: 0,
                        'aria-sort': active ? (r.dir === 'flip' ? 'descending' : 'ascending') : 'none' }, [text]);
    var toggle = function () {
      var now = route();
      var same = (now.sort || 'rank') === key;
      var next = Object.assign({}, now, { sort: key, dir: same && now.dir !== 'flip' ? 'flip' : '', page: '' });
      delete next.view;
      go('board', next);
    };
    th.addEventListener('click', toggle);
    th.addEventListener('keydown', function (e) { if (e.key === 'Enter') toggle(); });
    return th;
  }

  function boardCell(c, i, first) {
    var v = c.values[i];
    var td = el('td', { 'class': first ? 'first' : null });
    if (v === null) { td.textContent = '-'; return td; }
    var mark = c.marks ? c.marks.charAt(i) : '.';
    if (mark === '*') td.classList.add('best');
    if (mark === '~') td.classList.add('tied');
    var low = c.low[i], high = c.high[i], kind = KINDS[c.kind.charAt(i)];
    td.appendChild(document.createTextNode(fmt(v)));
    td.appendChild(el('span', { 'class': 'mark', text: mark === '.' ? '' : mark }));
    var tip = c.name + ' = ' + fmt(v);
    if (low !== null && high !== null) {
      tip += ' [' + fmt(low) + ', ' + fmt(high) + '] ' + pct(S.meta.level) +
             (kind === 'exact' ? ' exact binomial interval (every item scored the same)' : ' bootstrap interval');
      td.appendChild(intervalBar(c, v, low, high, kind));
    }
    if (c.n[i] !== null) tip += '; n=' + c.n[i];
    if (mark === '*') tip += '; best of its column';
    if (mark === '~') tip += '; not distinguishable from the best';
    td.title = tip;
    return td;
  }

  var KINDS = { b: 'bootstrap', e: 'exact', '.': '' };
  function columnRange(c) {
    if (c._range) return c._range;
    var lo = Infinity, hi = -Infinity;
    c.values.forEach(function (v, i) {
      if (v === null) return;
      lo = Math.min(lo, v, c.low[i] === null ? v : c.low[i]);
      hi = Math.max(hi, v, c.high[i] === null ? v : c.high[i]);
    });
    if (hi - lo < 1e-12) { lo -= 0.5; hi += 0.5; }
    c._range = [lo, hi];
    return c._range;
  }
  function intervalBar(c, v, low, high, kind) {
    var r = columnRange(c), span = r[1] - r[0];
    var x = function (t) { return ((t - r[0]) / span * 100).toFixed(2) + '%'; };
    return el('span', { 'class': 'bar' }, [
      el('span', { 'class': 'rng' + (kind === 'exact' ? ' exact' : ''),
                   style: 'left:' + x(low) + ';width:' + ((high - low) / span * 100).toFixed(2) + '%' }),
      el('span', { 'class': 'pt', style: 'left:' + x(v) })]);
  }

  function pager(page, pages, total, what) {
    var p = el('div', { 'class': 'pager' });
    p.appendChild(el('button', { disabled: page <= 0, text: '\u2190 previous',
                                 on: { click: function () { setParam('page', String(page - 1)); } } }));
    p.appendChild(el('span', { text: 'page ' + (page + 1) + ' of ' + pages + ' (' + total.toLocaleString() + ' ' + what + ')' }));
    p.appendChild(el('button', { disabled: page >= pages - 1, text: 'next \u2192',
                                 on: { click: function () { setParam('page', String(page + 1)); } } }));
    return p;
  }

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

  // --- items ---------------------------------------------------------------------------
  function evaluationsWithRecords() {
    return S.meta.evaluations.filter(function (e) { return e.records; }).map(function (e) { return e.name; });
  }
  function rightOrWrong(items, cell) {
    // the metric rayeval samples counts by (reporting.samples.right_or_wrong_metric)
    return items.right_or_wrong && cell[items.right_or_wrong] ? items.right_or_wrong : null;
  }
  function firstCountable(evs, k) {
    // the first evaluation whose items say right or wrong (else the first)
    if (k >= evs.length) return Promise.resolve(evs[0]);
    return get(q('items', { evaluation: evs[k] })).then(function (items) {
      return items && items.right_or_wrong ? evs[k] : firstCountable(evs, k + 1);
    });
  }
  function loadCells(ev, entries) {
    return Promise.all(entries.map(function (i) { return get(q('cell', { evaluation: ev, entry: i })); }));
  }

  function itemsView(main, r) {
    var evs = evaluationsWithRecords();
    if (!evs.length) {
      main.appendChild(el('p', { text: 'No evaluation of this store kept per-item records (samples: true keeps them; text tasks and classification do by default).' }));
      return;
    }
    var ev = r.evaluation && evs.indexOf(r.evaluation) >= 0 ? r.evaluation : evs[0];
    if (r.entry !== undefined && !VIEWS) get(q('cell', { evaluation: ev, entry: +r.entry })).catch(function () {});  // beside the items
    return get(q('items', { evaluation: ev })).then(function (items) {
      if (!items) { main.appendChild(el('p', { text: 'This file holds no items of ' + ev + '; rayeval view STORE shows them.' })); return; }
      var holders = items.entries;
      var a = r.entry !== undefined && holders.indexOf(+r.entry) >= 0 ? +r.entry : holders[0];
      var bsel = r.b !== undefined && r.b !== '' && holders.indexOf(+r.b) >= 0 ? +r.b : null;
      var bar = el('div', { 'class': 'controls' });
      bar.appendChild(select('evaluation', 'Evaluation', evs, ev, '', function (e) { go('items', { evaluation: e.target.value }); }));
      bar.appendChild(select('entry', 'Checkpoint', holders.map(function (i) { return [String(i), entryLabel(i)]; }), String(a)));
      bar.appendChild(select('b', 'Against', [['', 'none']].concat(holders.map(function (i) { return [String(i), entryLabel(i)]; })), bsel === null ? '' : String(bsel)));
      var search = el('input', { type: 'search', name: 'q', placeholder: 'Search items (text, id, answer)', value: r.q || '' });
      search.addEventListener('change', function () { clearTimeout(S.typing); setParam('q', search.value); });
      // narrows as one types: a pause of 250 ms applies it; the new view's box keeps the caret
      search.addEventListener('input', function () {
        clearTimeout(S.typing);
        S.typing = setTimeout(function () { S.typed = true; setParam('q', search.value); }, 250);
      });
      bar.appendChild(el('label', null, ['Search ', search]));
      if (items.right_or_wrong) {          // perplexity items are not right or wrong
        bar.appendChild(check('wrong', 'wrong only', r));
        bar.appendChild(check('flipped', 'flipped against B', r));
      }
      var ranged = items.right_or_wrong || items.metrics[0];
      if (ranged) bar.appendChild(el('label', null, [ranged + ' from ', rangeInput('min', r), ' to ', rangeInput('max', r)]));
      var orders = [['', items.right_or_wrong ? 'by id' : 'by ' + items.metrics[0] + ', worst first'], ['id', 'by id'],
        ['metric', 'by metric, worst first'], ['margin', 'by log-likelihood margin'], ['confidence', 'by confidence, most confident first']];
      bar.appendChild(select('order', 'Sort', orders, r.order || ''));
      main.appendChild(bar);
      if (S.typed) { S.typed = false; search.focus(); search.setSelectionRange(search.value.length, search.value.length); }
      var wanted = [a].concat(bsel === null ? [] : [bsel]);
      return loadCells(ev, wanted).then(function (cells) {
        var cell = cells[0], other = bsel === null ? null : cells[1];
        var metric = rightOrWrong(items, cell);
        var list = filterItems(items, cell, other, metric, r);
        if ((items.target || []).length && cell.probability) main.appendChild(confusion(items, cell, ev, a, r));
        var page = +(r.page || 0), pages = Math.max(1, Math.ceil(list.length / PAGE));
        main.appendChild(el('p', { 'class': 'note', text: list.length.toLocaleString() + ' of ' + items.id.length.toLocaleString() +
          ' items' + (metric ? '; right or wrong by ' + metric : '') }));
        var holder = el('div', { 'class': 'items' });
        list.slice(page * PAGE, page * PAGE + PAGE).forEach(function (k) {
          holder.appendChild(itemCard(items, cell, other, metric, k, ev, a, bsel));
        });
        main.appendChild(holder);
        main.appendChild(pager(page, pages, list.length, 'items'));
      });
    });
  }
  function check(name, label, r) {
    return el('label', null, [el('input', { type: 'checkbox', name: name, checked: r[name] === '1',
      on: { change: function (e) { setParam(name, e.target.checked ? '1' : ''); } } }), label]);
  }
  function rangeInput(name, r) {
    return el('input', { type: 'number', step: 'any', name: name, style: 'width:6em', value: r[name] || '',
      on: { change: function (e) { setParam(name, e.target.value); } } });
  }
  function text(v) { return v === null || v === undefined ? '' : String(v); }
  function margin(items, cell, k) {
    var ll = cell.loglikelihoods && cell.loglikelihoods[k], ch = items.choices && items.choices[k];
    if (!ll || !ch || ll.length < 2) return null;
    var t = ch.indexOf(items.target[k]);
    if (t < 0) return null;
    var other = -Infinity;
    ll.forEach(function (x, j) { if (j !== t) other = Math.max(other, x); });
    return ll[t] - other;
  }
  function filterItems(items, cell, other, metric, r) {
    var n = items.id.length, out = [];
    var needle = (r.q || '').toLowerCase();
    var shown = items.metrics.filter(function (m) { return cell[m]; });
    var m = metric || shown[0];
    var lo = r.min === undefined || r.min === '' ? null : +r.min, hi = r.max === undefined || r.max === '' ? null : +r.max;
    for (var k = 0; k < n; k++) {
      if (r.wrong === '1' && !(metric && cell[metric][k] === 0)) continue;
      if (r.flipped === '1' && !(other && metric && cell[metric][k] !== null && other[metric][k] !== null &&
                                 cell[metric][k] !== other[metric][k])) continue;
      if (m && (lo !== null || hi !== null)) {
        var v = cell[m][k];
        if (v === null || (lo !== null && v < lo) || (hi !== null && v > hi)) continue;
      }
      if (r.target !== undefined && text(items.target[k]) !== r.target) continue;
      if (r.pred !== undefined && text(cell.response[k]) !== r.pred) continue;
      if (needle) {
        var hay = [items.id[k], items.context && items.context[k], items.target && items.target[k],
                   cell.response && cell.response[k], other && other.response && other.response[k],
                   items.choices && items.choices[k] && items.choices[k].join(' ')].map(text).join('\n').toLowerCase();
        if (hay.indexOf(needle) < 0) continue;
      }
      out.push(k);
    }
    var key = null, order = r.order || (metric ? '' : 'metric');   // perplexity: worst first
    if (order === 'metric' && m) {
      var sign = m === metric ? 1 : (S.board.columns.filter(function (c) { return c.metric === m && c.evaluation === items.evaluation; })[0] || { higher: true }).higher ? 1 : -1;
      key = function (k) { var v = cell[m][k]; return v === null ? Infinity : sign * v; };
    } else if (order === 'margin') key = function (k) { var v = margin(items, cell, k); return v === null ? Infinity : v; };
    else if (order === 'confidence' && cell.probability) key = function (k) { var v = cell.probability[k]; return v === null ? Infinity : -v; };
    if (key) out.sort(function (x, y) { return key(x) - key(y) || x - y; });
    return out;
  }

  function shownAnswer(v) {
    // whitespace and newlines visible; an empty answer says so
    if (v === null || v === undefined) return el('span', { 'class': 'muted', text: '(none)' });
    if (v === '') return el('span', { 'class': 'empty', text: '(empty)' });
    var span = el('span', { 'class': 'answer' });
    String(v).split(/(\n| +|\t)/).forEach(function (part) {
      if (part === '\n') { span.appendChild(el('span', { 'class': 'ws', text: '\u21b5' })); span.appendChild(document.createTextNode('\n')); }
      else if (/^ +$/.test(part)) span.appendChild(el('span', { 'class': 'ws', text: part.replace(/ /g, '\u00b7') }));
      else if (part === '\t') span.appendChild(el('span', { 'class': 'ws', text: '\u2192' }));
      else if (part) span.appendChild(document.createTextNode(part));
    });
    return span;
  }
  function field(label, value) {
    return el('div', { 'class': 'field' }, [el('span', { 'class': 'label', text: label }), value]);
  }

  function itemCard(items, cell, other, metric, k, ev, a, b) {
    var right = metric && cell[metric][k] !== null ? (cell[metric][k] === 1 ? 'right' : 'wrong') : '';
    var card = el('div', { 'class': 'item ' + right, 'data-id': text(items.id[k]) });
    var thumbs = items.thumbnails && items.thumbnails[k];
    if (thumbs && thumbs.length) {
      var side = el('div', { 'class': 'images' });
      thumbs.forEach(function (src, j) {
        var source = items.images && items.images[k] ? items.images[k][j] : '';
        var img = el('img', { src: src, alt: 'image ' + (j + 1) + ' of item ' + items.id[k], title: source || '' });
        img.addEventListener('click', function () { zoom(src, source); });
        side.appendChild(img);
      });
      card.appendChild(side);
    }
    var body = el('div', { 'class': 'body' });
    body.appendChild(field('id', el('a', { href: '#item?evaluation=' + encodeURIComponent(ev) + '&id=' + encodeURIComponent(text(items.id[k])) + '&entry=' + a,
                                            text: text(items.id[k]) })));
    var context = cell.context ? cell.context[k] : items.context && items.context[k];
    if (context !== null && context !== undefined) {
      var long = context.length > 600;
      body.appendChild(el('details', { open: !long }, [el('summary', { text: 'input (' + context.length + ' characters)' }),
                                                     el('pre', { text: context })]));
    }
    if (items.choices && items.choices[k]) body.appendChild(choicesTable(items, cell, k));
    else {
      var raw = cell.raw_response && cell.raw_response[k];
      if (cell.responses && cell.responses[k]) cell.responses[k].forEach(function (v, j) { body.appendChild(field('answer ' + (j + 1), shownAnswer(v))); });
      else if (cell.response) body.appendChild(field((cell.probability ? 'prediction' : 'answer') + (b === null ? '' : ' A'), shownAnswer(cell.response[k])));
      if (raw !== null && raw !== undefined && raw !== (cell.response && cell.response[k])) body.appendChild(field('raw generation', shownAnswer(raw)));
      if (other && other.response) body.appendChild(field('answer B', shownAnswer(other.response[k])));
      if (items.target && items.target[k] !== null) body.appendChild(field('target', shownAnswer(items.target[k])));
    }
    if (cell.probability && cell.probability[k] !== null) body.appendChild(field('probability', document.createTextNode(fmt(cell.probability[k]))));
    judged(body, cell, k, 'judge');
    var values = items.metrics.filter(function (m) { return cell[m] && cell[m][k] !== null; })
      .map(function (m) { return m + ' ' + fmt(cell[m][k]) + (other && other[m] ? ' (B ' + fmt(other[m][k]) + ')' : ''); });
    if (values.length) body.appendChild(el('div', { 'class': 'field muted', text: values.join(', ') }));
    card.appendChild(body);
    return card;
  }
  function choicesTable(items, cell, k) {
    var ch = items.choices[k], ll = cell.loglikelihoods && cell.loglikelihoods[k];
    var target = items.target[k];
    var norm = ll ? ll.map(function (x, j) { return x / Math.max(1, Array.from(ch[j]).length); }) : null;
    var argmax = function (xs) { var b = 0; xs.forEach(function (x, j) { if (x > xs[b]) b = j; }); return b; };
    var pick = ll ? argmax(ll) : ch.indexOf(cell.response[k]);
    var pickNorm = norm ? argmax(norm) : -1;
    var t = el('table', { 'class': 'choices' }, [el('thead', null, [el('tr', null, [
      el('th', { text: 'choice' }), el('th', { text: 'log-likelihood' }), el('th', { text: 'per character (acc_norm)' })])])]);
    var tb = el('tbody');
    ch.forEach(function (c, j) {
      var tags = [];
      if (c === target) tags.push(el('span', { 'class': 'tag target', text: 'target' }));
      if (j === pick) tags.push(el('span', { 'class': 'tag ' + (c === target ? 'pick' : 'wrongpick'), text: 'acc pick' }));
      if (j === pickNorm && pickNorm !== pick) tags.push(el('span', { 'class': 'tag ' + (c === target ? 'pick' : 'wrongpick'), text: 'acc_norm pick' }));
      tb.appendChild(el('tr', { 'class': c === target ? 'target' : null }, [
        el('td', null, [c].concat(tags)),
        el('td', { text: ll ? fmt(ll[j]) : '-' }), el('td', { text: norm ? fmt(norm[j]) : '-' })]));
    });
    t.appendChild(tb);
    return t;
  }
  function judged(body, cell, k) {
    if (!cell.judge_output && !cell.judge_failed) return;
    var said = cell.judge_output ? cell.judge_output[k] : null;
    var failed = cell.judge_failed ? cell.judge_failed[k] : null;
    if (said === null && !failed) return;
    body.appendChild(field('judge said', said === null ? el('span', { 'class': 'muted', text: '(no text: the prompt did not fit)' }) : shownAnswer(said)));
    if (failed) body.appendChild(field('judge failed', el('span', { 'class': 'error', text: failed })));
    if (cell.baseline_response) body.appendChild(field('baseline', shownAnswer(cell.baseline_response[k])));
    if (cell.judge_prompt && cell.judge_prompt[k] !== null)
      body.appendChild(el('details', null, [el('summary', { text: 'judge prompt' }), el('pre', { text: cell.judge_prompt[k] })]));
    if (cell.judge_output_swapped && cell.judge_output_swapped[k] !== null)
      body.appendChild(field('judge, swapped', shownAnswer(cell.judge_output_swapped[k])));
  }
  function zoom(src, source) {
    var o = el('div', { 'class': 'overlay', on: { click: function () { o.remove(); } } }, [
      el('img', { src: src, alt: source || 'image' }), el('p', { text: (source || '') + ' (the stored thumbnail; click to close)' })]);
    document.body.appendChild(o);
  }

  function confusion(items, cell, ev, a, r) {
    var labels = Array.from(new Set(items.target.map(text).concat(cell.response.map(text)))).sort(function (x, y) {
      return isNaN(x) || isNaN(y) ? (x < y ? -1 : 1) : x - y;
    });
    var at = {}; labels.forEach(function (l, j) { at[l] = j; });
    var m = labels.map(function () { return labels.map(function () { return 0; }); });
    items.target.forEach(function (t, k) { if (cell.response[k] !== null) m[at[text(t)]][at[text(cell.response[k])]]++; });
    var top = Math.max.apply(null, m.map(function (row) { return Math.max.apply(null, row); })) || 1;
    var t = el('table', { 'class': 'heat' });
    t.appendChild(el('tr', null, [el('th', { text: 'target \\ prediction' })].concat(labels.map(function (l) { return el('th', { text: l }); }))));
    m.forEach(function (row, i) {
      var tr = el('tr', null, [el('th', { text: labels[i] })]);
      row.forEach(function (v, j) {
        var shade = v / top, good = i === j;
        var bg = good ? 'rgba(19,115,51,' + (0.1 + 0.8 * shade).toFixed(3) + ')' : 'rgba(179,38,30,' + (v ? 0.1 + 0.8 * shade : 0).toFixed(3) + ')';
        tr.appendChild(el('td', { style: 'background:' + bg + (shade > 0.55 ? ';color:#fff' : ''), text: String(v),
          title: v + ' item(s) of ' + labels[i] + ' predicted ' + labels[j] + '; click to list them',
          'data-target': labels[i], 'data-pred': labels[j],
          on: { click: function () { go('items', { evaluation: ev, entry: a, target: labels[i], pred: labels[j], order: 'confidence' }); } } }));
      });
      t.appendChild(tr);
    });
    var box = el('details', { open: true }, [el('summary', { text: 'confusion matrix (rows: target, columns: prediction); a cell lists its items, most confident first' }),
                                             el('div', { 'class': 'scroll' }, [t])]);
    if (r.target !== undefined) box.appendChild(el('p', null, ['Showing target ' + r.target + ', predicted ' + r.pred + ' ',
      el('a', { href: '#items?evaluation=' + encodeURIComponent(ev) + '&entry=' + a + '&wrong=1&order=confidence', text: '(all mistakes, most confident first)' })]));
    return box;
  }

  // one item across every checkpoint
  function itemPage(main, r) {
    var ev = r.evaluation;
    return get(q('items', { evaluation: ev })).then(function (items) {
      var k = items.id.map(text).indexOf(r.id);
      if (k < 0) throw new Error('no item ' + r.id + ' in ' + ev);
      var a = r.entry !== undefined ? +r.entry : items.entries[0];
      var order = items.entries.slice().sort(function (x, y) {
        var ex = S.board.entries[x], ey = S.board.entries[y];
        return ex.sweep < ey.sweep ? -1 : ex.sweep > ey.sweep ? 1 : (ex.step || 0) - (ey.step || 0);
      });
      main.appendChild(el('p', null, [el('a', { href: '#items?evaluation=' + encodeURIComponent(ev) + '&entry=' + a, text: '\u2190 ' + ev + "'s items" })]));
      var few = order.length <= 200;
      return loadCells(ev, few ? order : [a]).then(function (cells) {
        var byEntry = {}; (few ? order : [a]).forEach(function (i, j) { byEntry[i] = cells[j]; });
        var cell = byEntry[a];
        var metric = rightOrWrong(items, cell);
        main.appendChild(itemCard(items, cell, null, metric, k, ev, a, null));
        if (!few || !metric) return;
        main.appendChild(el('h2', { text: 'Across checkpoints (' + metric + ')' }));
        var strip = el('div', { 'class': 'strip', 'data-item': r.id });
        order.forEach(function (i) {
          var v = byEntry[i][metric][k];
          strip.appendChild(el('span', { 'class': v === 1 ? 'r' : v === 0 ? 'w' : '', title: entryLabel(i) + ': ' + (v === 1 ? 'right' : v === 0 ? 'wrong' : 'no record'),
                                         'data-entry': i }));
        });
        main.appendChild(strip);
        var t = el('table', null, [el('tr', null, ['checkpoint', metric, 'answer'].map(function (h) { return el('th', { text: h }); }))]);
        order.forEach(function (i) {
          var c = byEntry[i];
          t.appendChild(el('tr', null, [el('td', { 'class': 'name', text: entryLabel(i) }), el('td', { text: fmt(c[metric][k], 0) }),
            el('td', { style: 'text-align:left;white-space:normal' }, [shownAnswer(c.response ? c.response[k] : null)])]));
        });
        main.appendChild(el('div', { 'class': 'scroll' }, [t]));
      });
    });
  }

  // --- A against B ---------------------------------------------------------------------
  function mcnemar(b, c) {
    // exact two-sided McNemar: the binomial test of b against b + c at 1/2
    var n = b + c;
    if (n === 0) return 1;
    var k = Math.min(b, c), lf = [0];
    for (var i = 1; i <= n; i++) lf.push(lf[i - 1] + Math.log(i));
    var p = 0;
    for (var j = 0; j <= k; j++) p += Math.exp(lf[n] - lf[j] - lf[n - j] - n * Math.LN2);
    return Math.min(1, 2 * p);
  }
  function compareView(main, r) {
    var evs = evaluationsWithRecords();
    if (!evs.length) { main.appendChild(el('p', { text: 'No evaluation kept per-item records; A against B needs them.' })); return; }
    var chosen = r.evaluation && evs.indexOf(r.evaluation) >= 0 ? Promise.resolve(r.evaluation) : firstCountable(evs, 0);
    var ev;
    return chosen.then(function (found) { ev = found; return get(q('items', { evaluation: ev })); }).then(function (items) {
      if (!items) { main.appendChild(el('p', { text: 'This file holds no items of ' + ev + '.' })); return; }
      var holders = items.entries;
      var a = r.a !== undefined && holders.indexOf(+r.a) >= 0 ? +r.a : holders[0];
      var b = r.b !== undefined && holders.indexOf(+r.b) >= 0 ? +r.b : holders[Math.min(1, holders.length - 1)];
      var bar = el('div', { 'class': 'controls' });
      var opts = holders.map(function (i) { return [String(i), entryLabel(i)]; });
      bar.appendChild(select('evaluation', 'Evaluation', evs, ev, '', function (e) { go('compare', { evaluation: e.target.value }); }));
      bar.appendChild(select('a', 'A', opts, String(a)));
      bar.appendChild(select('b', 'B', opts, String(b)));
      main.appendChild(bar);
      // rayeval view computes the paired difference on the store when asked (up to a minute on a
      // big one): the counts are shown without waiting for it, the line filled when it comes
      var served = !VIEWS;
      return Promise.all([loadCells(ev, [a, b]), served ? null : get(pairedOf(b))]).then(function (got) {
        var ca = got[0][0], cb = got[0][1];
        var metric = rightOrWrong(items, ca);
        if (!metric) { main.appendChild(el('p', { text: ev + "'s items have no right-or-wrong metric to count." })); return; }
        var n = { both_right: 0, a_only: 0, b_only: 0, both_wrong: 0 }, aOnly = [], bOnly = [];
        items.id.forEach(function (_, k) {
          var x = ca[metric][k], y = cb[metric][k];
          if (x === null || y === null) return;
          if (x === 1 && y === 1) n.both_right++;
          else if (x === 1) { n.a_only++; aOnly.push(k); }
          else if (y === 1) { n.b_only++; bOnly.push(k); }
          else n.both_wrong++;
        });
        var cnt = function (key) { return el('td', { 'data-count': key, text: String(n[key]) }); };
        main.appendChild(el('table', { 'class': 'counts' }, [
          el('tr', null, [el('th'), el('th', { text: 'B right' }), el('th', { text: 'B wrong' })]),
          el('tr', null, [el('th', { text: 'A right' }), cnt('both_right'), cnt('a_only')]),
          el('tr', null, [el('th', { text: 'A wrong' }), cnt('b_only'), cnt('both_wrong')])]));
        var p = mcnemar(n.a_only, n.b_only);
        main.appendChild(el('p', { 'class': 'mcnemar', 'data-p': String(p), text: 'McNemar exact test (' + metric + ', ' + (n.a_only + n.b_only) +
          ' discordant items): p = ' + (p < 1e-4 ? p.toExponential(2) : p.toFixed(4)) }));
        var colName = S.board.columns.filter(function (c) { return c.evaluation === ev && c.metric === metric; })[0];
        var line = el('p', { 'class': 'paired' });
        var fill = function (paired) {
          if (served || paired) {
            var d = paired && colName ? paired.columns[colName.name][a] : null;
            line.textContent = d ? 'Paired bootstrap: A \u2212 B on ' + colName.name + ' = ' + fmt(d[0]) + ' [' + fmt(d[1]) + ', ' + fmt(d[2]) + '] (' + pct(S.meta.level) + ')' :
              'No paired bootstrap difference: the two cells do not share resamples.';
            if (d) { line.setAttribute('data-difference', String(d[0])); line.setAttribute('data-low', String(d[1])); line.setAttribute('data-high', String(d[2])); }
          } else line.textContent = 'The paired bootstrap difference to this B is not in this file; rayeval view STORE computes it.';
        };
        if (served) {
          line.textContent = 'Paired bootstrap: computing A \u2212 B on the store\u2026';
          line.setAttribute('data-pending', '');
          get(pairedOf(b, colName ? [colName.name] : null)).then(function (paired) { line.removeAttribute('data-pending'); fill(paired); },
            function (e) { line.removeAttribute('data-pending'); line.textContent = 'No paired bootstrap difference: ' + e.message; });
        } else fill(got[1]);
        main.appendChild(line);
        main.appendChild(el('p', null, ['A: ' + entryLabel(a) + '; B: ' + entryLabel(b) + '. ',
          el('a', { href: '#items?evaluation=' + encodeURIComponent(ev) + '&entry=' + a + '&b=' + b + '&flipped=1', text: 'every flipped item, searchable' })]));
        var two = el('div', { 'class': 'two' });
        [['Right in A, wrong in B', aOnly], ['Right in B, wrong in A', bOnly]].forEach(function (part) {
          var col = el('div', { 'class': 'flipped' }, [el('h2', { text: part[0] + ': ' + part[1].length })]);
          part[1].slice(0, PAGE).forEach(function (k) { col.appendChild(itemCard(items, ca, cb, metric, k, ev, a, b)); });
          if (part[1].length > PAGE) col.appendChild(el('p', { 'class': 'note', text: 'the first ' + PAGE + '; the items view pages through all' }));
          two.appendChild(col);
        });
        main.appendChild(two);
      });
    });
  }

  // --- provenance ----------------------------------------------------------------------
  function dl(pairs) {
    var d = el('dl', { 'class': 'meta' });
    pairs.forEach(function (p) { d.appendChild(el('dt', { text: p[0] })); d.appendChild(el('dd', null, [typeof p[1] === 'string' ? p[1] : p[1]])); });
    return d;
  }
  function aboutView(main) {
    var m = S.meta;
    main.appendChild(el('h2', { text: 'Provenance' }));
    main.appendChild(dl([['store', m.store], ['sweeps', m.sweeps.join(', ')],
      ['filters', Object.keys(m.filters).map(function (k) { return k + '=' + m.filters[k]; }).join(', ') || 'none'],
      ['checkpoints', String(m.checkpoints)], ['cells', String(m.cells)],
      ['intervals', pct(m.level) + ' percentile bootstrap over items (paired across checkpoints)'],
      ['evaluated', m.evaluated ? m.evaluated[0] + ' to ' + m.evaluated[1] : '-'],
      ['this page', 'made ' + m.generated + ' by rayeval ' + m.version]]));
    var t = el('table', null, [el('tr', null, ['evaluation', 'rows', 'scored tokens', 'bootstrap', 'per-item records'].map(function (h) { return el('th', { text: h }); }))]);
    m.evaluations.forEach(function (e) {
      t.appendChild(el('tr', null, [el('td', { 'class': 'name' }, [e.records ? el('a', { href: '#items?evaluation=' + encodeURIComponent(e.name), text: e.name }) : e.name]),
        el('td', { text: e.rows === null ? '-' : e.rows.toLocaleString() }), el('td', { text: e.tokens === null ? '-' : e.tokens.toLocaleString() }),
        el('td', { 'class': 'mono', text: e.bootstrap || '-' }), el('td', { text: e.records ? 'yes' : 'no' })]));
    });
    main.appendChild(el('div', { 'class': 'scroll' }, [t]));
    if (m.sweep_files && Object.keys(m.sweep_files).length) Object.keys(m.sweep_files).forEach(function (s) {
      main.appendChild(el('details', null, [el('summary', { text: 'sweep file of ' + s }), el('pre', { text: m.sweep_files[s] })]));
    });
    var keys = el('details', null, [el('summary', { text: 'cell keys (' + m.cells + ')' })]);
    var kt = el('table', null, [el('tr', null, ['checkpoint', 'evaluation', 'cell key'].map(function (h) { return el('th', { text: h }); }))]);
    S.board.entries.slice(0, 2000).forEach(function (e, i) {
      Object.keys(e.cells).forEach(function (ev) {
        kt.appendChild(el('tr', null, [el('td', { 'class': 'name' }, [el('a', { href: '#entry?entry=' + i, text: entryLabel(i) })]), el('td', { 'class': 'name', text: ev }), el('td', { 'class': 'mono', text: e.cells[ev] })]));
      });
    });
    keys.appendChild(el('div', { 'class': 'scroll' }, [kt]));
    main.appendChild(keys);
  }
  function entryView(main, r) {
    var i = +r.entry, e = S.board.entries[i];
    if (!e) throw new Error('no such checkpoint');
    main.appendChild(el('p', null, [el('a', { href: '#board', text: '\u2190 board' })]));
    main.appendChild(el('h2', { text: entryLabel(i) }));
    main.appendChild(dl([['location', e.checkpoint], ['sweep', e.sweep], ['step', e.step === null ? '-' : String(e.step)],
                         ['rank', String(e.rank)], ['state', e.stopped || 'complete']]));
    var t = el('table', null, [el('tr', null, ['column', 'value', 'interval', 'n', 'cell key', ''].map(function (h) { return el('th', { text: h }); }))]);
    S.board.columns.forEach(function (c) {
      if (c.values[i] === null) return;
      var ev = c.evaluation, rec = evaluationsWithRecords().indexOf(ev) >= 0;
      t.appendChild(el('tr', null, [el('td', { 'class': 'name', text: c.name }), boardCell(c, i, false),
        el('td', { text: c.low[i] === null ? '-' : '[' + fmt(c.low[i]) + ', ' + fmt(c.high[i]) + ']' + (c.kind.charAt(i) === 'e' ? ' exact' : '') }),
        el('td', { text: c.n[i] === null ? '-' : String(c.n[i]) }), el('td', { 'class': 'mono', text: e.cells[ev] || '' }),
        el('td', null, [rec ? el('a', { href: '#items?evaluation=' + encodeURIComponent(ev) + '&entry=' + i, text: 'items' }) : ''])]));
    });
    main.appendChild(el('div', { 'class': 'scroll' }, [t]));
  }

  // --- start ---------------------------------------------------------------------------
  window.addEventListener('hashchange', render);
  Promise.all([get('meta'), get('board')]).then(function (got) {
    S.meta = got[0]; S.board = got[1];
    S.board.columns.forEach(function (c) { if (S.board.marked.indexOf(c.name) < 0 && c.marks && /^\.*$/.test(c.marks)) c.marks = null; });
    render();
  }).catch(function (e) {
    document.getElementById('main').appendChild(el('p', { 'class': 'error', text: 'The report could not load: ' + (e.message || e) }));
  });
})();
