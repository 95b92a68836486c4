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
        return get(q('marks', { columns: JSON.stringify(chunk) })).then(function (m) {
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
