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
      main.appendChild(el('p', { text: 'No evaluation of this store stored per-item records (samples: true keeps them; text tasks and classification do by default).' }));
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
      var named = items.named || 'id';      // 'row' where the data has no id column
      var orders = [['', items.right_or_wrong ? 'by ' + named : 'by ' + items.metrics[0] + ', worst first'], ['id', 'by ' + named],
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
    body.appendChild(field(items.named || 'id', el('a', { href: '#item?evaluation=' + encodeURIComponent(ev) + '&id=' + encodeURIComponent(text(items.id[k])) + '&entry=' + a,
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
