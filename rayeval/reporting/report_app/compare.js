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
    if (!evs.length) { main.appendChild(el('p', { text: 'No evaluation stored per-item records; A against B needs them.' })); return; }
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
