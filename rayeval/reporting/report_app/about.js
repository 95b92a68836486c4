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
