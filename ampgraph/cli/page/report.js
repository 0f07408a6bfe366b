(function(){
'use strict';
var D=JSON.parse(document.getElementById('amp-data').textContent);
var S=D.s, C=D.colors, hidden={};
var NODE_W=150, CAST_W=110, NODE_H=34, H_GAP=16, V_GAP=28, PAD=16, SVG='http://www.w3.org/2000/svg';

function el(tag, attrs, text){
  var e=document.createElement(tag);
  for(var k in attrs){ if(k==='cls'){e.className=attrs[k];} else {e.setAttribute(k, attrs[k]);} }
  if(text!==undefined){ e.textContent=text; }
  return e;
}
function color(p){ return C[p]||C['n/a']; }
function inside(module, path){ return path===''||module===path||module.indexOf(path+'.')===0; }
function human(n){
  var u=['','K','M','G','T','P'], i=0;
  while(Math.abs(n)>=1000&&i<u.length-1){ n/=1000; i++; }
  return (i?n.toFixed(2):n.toFixed(0))+' '+u[i]+'FLOP';
}

/* ---------------------------------------------------------------- precision filter */
var listeners=[];
function applyFilter(){ for(var i=0;i!==listeners.length;i++){ listeners[i](); } }
document.querySelectorAll('.legend button').forEach(function(b){
  b.addEventListener('click', function(){
    var p=b.getAttribute('data-p');
    hidden[p]=!hidden[p]; b.classList.toggle('off', !!hidden[p]);
    b.setAttribute('aria-pressed', hidden[p]?'false':'true');
    applyFilter();
  });
});

/* ---------------------------------------------------------------- node tables */
function rowCells(r){
  var p=S[r[3]], tr=el('tr', {'data-p':p});
  tr.appendChild(el('td', {cls:'nm'}, r[0]));
  tr.appendChild(el('td', {cls:'op'}, S[r[1]]));
  tr.appendChild(el('td', {cls:'md'}, S[r[2]]));
  var pc=el('td', {cls:'p'}, p); pc.style.background=color(p); tr.appendChild(pc);
  tr.appendChild(el('td', {cls:'rs'}, S[r[4]]));
  return tr;
}
function table(rows, withSearch){
  var box=el('div'), q=null, count=el('span');
  if(withSearch){
    q=el('input', {cls:'q', type:'search', placeholder:'filter: name, op, module, precision, reason',
                   'aria-label':'filter nodes'});
    var bar=el('p'); bar.appendChild(q); bar.appendChild(document.createTextNode(' '));
    bar.appendChild(count); box.appendChild(bar);
  }
  var t=el('table', {cls:'nodes'}), head=el('tr');
  ['name','op','module','precision','reason'].forEach(function(h){ head.appendChild(el('th', {}, h)); });
  var thead=el('thead'); thead.appendChild(head); t.appendChild(thead);
  var body=el('tbody'), trs=[];
  rows.forEach(function(r){ var tr=rowCells(r); trs.push(tr); body.appendChild(tr); });
  t.appendChild(body); box.appendChild(t);
  function apply(){
    var s=q?q.value.toLowerCase():'', shown=0;
    trs.forEach(function(tr){
      var hit=!hidden[tr.getAttribute('data-p')]&&(!s||tr.textContent.toLowerCase().indexOf(s)!==-1);
      tr.style.display=hit?'':'none'; if(hit){ shown++; }
    });
    count.textContent=shown+' of '+trs.length+' rows';
  }
  if(q){ q.addEventListener('input', apply); }
  listeners.push(apply); apply();
  return box;
}
function rowsOf(path, kind){
  return D.rows.filter(function(r){ return r[6]===kind&&inside(S[r[2]], path); });
}

/* ---------------------------------------------------------------- graphs */
function subgraph(path, book){
  var keep={}, ids=[];
  D.v.forEach(function(n, i){
    var isIO=n[4]==='input'||n[4]==='output';
    if((isIO&&path==='')||(!isIO&&inside(S[n[5]], path))){ keep[i]=true; ids.push(i); }
  });
  var preds={}, succ={};
  ids.forEach(function(i){ preds[i]=[]; succ[i]=[]; });
  D.e.forEach(function(e){ if(keep[e[0]]&&keep[e[1]]){ preds[e[1]].push(e[0]); succ[e[0]].push(e[1]); } });
  if(!book){  /* drop shape and data-movement nodes, joining their neighbours */
    var shown=ids.filter(function(i){ return !D.v[i][8]; }), near={};
    var reach=function(i){
      if(near[i]){ return near[i]; }
      var out=[];
      preds[i].forEach(function(p){ if(D.v[p][8]){ out=out.concat(reach(p)); } else { out.push(p); } });
      near[i]=out; return out;
    };
    var np={}, ns={};
    shown.forEach(function(i){ ns[i]=[]; });
    shown.forEach(function(i){
      var seen={};
      np[i]=reach(i).filter(function(p){ if(seen[p]){ return false; } seen[p]=true; return true; });
      np[i].forEach(function(p){ ns[p].push(i); });
    });
    return {ids:shown, preds:np, succ:ns};
  }
  return {ids:ids, preds:preds, succ:succ};
}
function layout(g){
  var depth={}, layers={}, order={}, pos={};
  g.ids.forEach(function(i){  /* ids are in topological order, but for fused casts */
    var d=0; g.preds[i].forEach(function(p){ if(depth[p]!==undefined){ d=Math.max(d, depth[p]+1); } });
    depth[i]=d;
  });
  g.ids.forEach(function(i){  /* weight casts and other sources: right above their consumer */
    if(!g.preds[i].length&&g.succ[i].length){
      var m=Infinity; g.succ[i].forEach(function(s){ m=Math.min(m, depth[s]); });
      depth[i]=Math.max(m-1, 0);
    }
  });
  g.ids.forEach(function(i){ (layers[depth[i]]=layers[depth[i]]||[]).push(i); });
  var levels=Object.keys(layers).map(Number).sort(function(a, b){ return a-b; });
  levels.forEach(function(d){ layers[d].forEach(function(i, k){ order[i]=k; }); });
  function sweep(ls, nb){
    ls.forEach(function(d){
      var key={};
      layers[d].forEach(function(i){
        var s=0, n=0; nb[i].forEach(function(j){ s+=order[j]; n++; }); key[i]=n?s/n:order[i];
      });
      layers[d].sort(function(a, b){ return key[a]-key[b]; });
      layers[d].forEach(function(i, k){ order[i]=k; });
    });
  }
  sweep(levels, g.preds); sweep(levels.slice().reverse(), g.succ); sweep(levels, g.preds);
  var w=0;
  levels.forEach(function(d, row){
    var x=PAD;
    layers[d].forEach(function(i){
      var wd=D.v[i][4]==='cast'?CAST_W:NODE_W;
      pos[i]=[x, PAD+row*(NODE_H+V_GAP), wd, row]; x+=wd+H_GAP;
    });
    w=Math.max(w, x+PAD);
  });
  return {pos:pos, w:w, h:levels.length*(NODE_H+V_GAP)+PAD};
}
function svgEl(tag, attrs, text){
  var e=document.createElementNS(SVG, tag);
  for(var k in attrs){ e.setAttribute(k, attrs[k]); }
  if(text!==undefined){ e.textContent=text; }
  return e;
}
function cut(t, n){ return t.length<=n?t:t.slice(0, n-1)+'\u2026'; }
function drawGraph(path, box, picked, book){
  var g=subgraph(path, book), L=layout(g), pos=L.pos;
  var svg=svgEl('svg', {viewBox:'0 0 '+L.w+' '+L.h, role:'img', 'aria-label':'precision graph'});
  var nodes=[];
  g.ids.forEach(function(b){
    g.preds[b].forEach(function(a){
      var A=pos[a], B=pos[b], sx=A[0]+A[2]/2, sy=A[1]+NODE_H, tx=B[0]+B[2]/2, ty=B[1], my=(sy+ty)/2;
      svg.appendChild(svgEl('path', {'class':B[3]-A[3]>3?'edge long':'edge',
        d:'M'+sx+','+sy+' C'+sx+','+my+' '+tx+','+my+' '+tx+','+ty}));
    });
  });
  g.ids.forEach(function(i){
    var n=D.v[i], P=pos[i], prec=S[n[3]], kind=n[4];
    var grp=svgEl('g', {'class':(D.changed[n[1]]!==undefined&&kind==='op')?'node changed':'node'});
    grp.appendChild(svgEl('title', {}, n[1]+' | '+S[n[2]]+' | '+S[n[5]]+' | '+prec+' | '+S[n[6]]));
    grp.appendChild(svgEl('rect', {x:P[0], y:P[1], width:P[2], height:NODE_H,
      rx:(kind==='op'?5:17), fill:(kind==='cast'?C.cast:color(prec)), stroke:'#555'}));
    var l1=kind==='cast'?n[1]:cut(n[1], 22), l2=kind==='cast'?cut(n[7], 17):cut(S[n[2]]+' '+prec, 24);
    grp.appendChild(svgEl('text', {x:P[0]+P[2]/2, y:P[1]+14, 'text-anchor':'middle'}, l1));
    grp.appendChild(svgEl('text', {x:P[0]+P[2]/2, y:P[1]+27, 'text-anchor':'middle'}, l2));
    grp.addEventListener('click', function(){
      picked.textContent=n[1]+' ('+S[n[2]]+', '+(kind==='cast'?'cast':prec)+') in '+
        (S[n[5]]||'(model)')+': '+S[n[6]];
    });
    grp.setAttribute('data-p', kind==='cast'?'cast':prec);
    nodes.push(grp); svg.appendChild(grp);
  });
  box.textContent=''; box.appendChild(svg);
  var scale=1;
  function size(){ svg.setAttribute('width', L.w*scale); svg.setAttribute('height', L.h*scale); }
  function dim(){ nodes.forEach(function(n){ n.style.opacity=hidden[n.getAttribute('data-p')]?0.15:1; }); }
  listeners.push(dim); dim();
  return {zoom:function(f){ scale*=f; size(); },
          fit:function(){ scale=Math.min(1, Math.max(0.05, (box.clientWidth-4)/L.w)); size(); },
          n:g.ids.length};
}
function graphPanel(path){
  var panel=el('div', {cls:'panel'}), tools=el('div', {cls:'tools'}), box=el('div', {cls:'graph'});
  var picked=el('p', {cls:'picked'}, 'click a node for its precision and reason');
  var book=el('input', {type:'checkbox'}), lab=el('label');
  lab.appendChild(book); lab.appendChild(document.createTextNode(' shape and data-movement ops'));
  var g=null;
  function draw(){ g=drawGraph(path, box, picked, book.checked); g.fit(); }
  [['zoom in', function(){ g.zoom(1.25); }], ['zoom out', function(){ g.zoom(0.8); }],
   ['fit width', function(){ g.fit(); }]].forEach(function(b){
    var btn=el('button', {type:'button'}, b[0]); btn.addEventListener('click', b[1]); tools.appendChild(btn);
  });
  book.addEventListener('change', draw); tools.appendChild(lab);
  panel.appendChild(tools); panel.appendChild(box); panel.appendChild(picked);
  setTimeout(draw, 0);
  return panel;
}

/* ---------------------------------------------------------------- module tree */
function bar(f){
  var b=el('span', {cls:'bar', title:''}), tot=f[0]+f[1]+f[2], names=[D.low, 'fp8', 'fp32'];
  var tip=[];
  f.forEach(function(x, k){
    if(!x){ return; }
    var s=el('span'); s.style.width=(100*x/tot)+'%'; s.style.background=color(names[k]);
    b.appendChild(s); tip.push(names[k]+' '+(100*x/tot).toFixed(1)+'%');
  });
  b.title=tot?human(tot)+': '+tip.join(', '):'no matmul/conv FLOPs';
  return b;
}
function opsText(o){
  var n=0, parts=[];
  Object.keys(o).forEach(function(p){ n+=o[p]; parts.push(p+' '+o[p]); });
  return n+' ops ('+parts.join(', ')+')';
}
function toggle(li, sub, tog){
  var open=sub.style.display!=='none';
  sub.style.display=open?'none':''; tog.textContent=open?'\u25b8':'\u25be';
  tog.setAttribute('aria-expanded', open?'false':'true');
}
function why(reasons, lead){  /* the fp32 ops' reasons: one line, each in full on hover */
  var text=reasons.map(function(x){ return x[1]+' fp32: '+x[0].split('; ')[0]; }).join(' | ');
  return el('div', {cls:'why', title:reasons.map(function(x){ return x[1]+' x '+x[0]; }).join('\n')},
            'why fp32: '+lead+text);
}
function hasFold(e){ return (e.k||[]).some(function(c){ return c.fold!==undefined||hasFold(c); }); }
function entryLi(e, openIt){
  var li=el('li'), row=el('div', {cls:'entry', 'data-path':e.p});
  var tog=el('span', {cls:'tog', role:'button', tabindex:'0'}, e.k?'\u25b8':'');
  row.appendChild(tog); row.appendChild(el('span', {cls:'nm', title:e.p||'(model)'}, e.n));
  row.appendChild(bar(e.f));
  row.appendChild(el('span', {cls:'info'}, opsText(e.o)+' \u00b7 '+e.c+' casts \u00b7 '+e.w+' params'));
  var panels=el('div');
  [['ops', function(){ var b=el('div', {cls:'panel'}); b.appendChild(table(rowsOf(e.p, 0), true)); return b; }],
   ['graph', function(){ return graphPanel(e.p); }]].forEach(function(spec){
    var btn=el('button', {type:'button', 'data-open':spec[0]}, spec[0]), made=null;
    btn.addEventListener('click', function(){
      if(!made){ made=spec[1](); panels.appendChild(made); }
      else { made.style.display=made.style.display==='none'?'':'none'; }
    });
    row.appendChild(btn);
  });
  li.appendChild(row);
  if(e.d){ li.appendChild(el('div', {cls:'differs'}, e.d)); }
  if(e.r){ li.appendChild(why(e.r, '')); }
  li.appendChild(panels);
  if(e.k){
    var sub=el('ul', {cls:'tree'});
    e.k.forEach(function(c){ sub.appendChild(c.fold!==undefined?foldLi(c):entryLi(c, hasFold(c))); });
    li.appendChild(sub); sub.style.display='none';
    var flip=function(){ toggle(li, sub, tog); };
    tog.addEventListener('click', flip);
    tog.addEventListener('keydown', function(ev){ if(ev.key==='Enter'||ev.key===' '){ flip(); } });
    if(openIt){ flip(); }
  }
  li.setAttribute('data-ops', JSON.stringify(e.o));
  return li;
}
function foldLi(f){
  var li=el('li'), first=f.m[0], row=el('div', {cls:'entry fold', 'data-path':first.p});
  var tog=el('span', {cls:'tog', role:'button', tabindex:'0', 'aria-expanded':'false'}, '\u25b8');
  row.appendChild(tog); row.appendChild(el('span', {cls:'nm'}, f.fold));
  row.appendChild(bar(first.f));
  row.appendChild(el('span', {cls:'info'}, f.m.length+' blocks, identical plan: each '+opsText(first.o)+
    ' \u00b7 '+first.c+' casts'));
  li.appendChild(row);
  if(first.r){ li.appendChild(why(first.r, 'each: ')); }
  var sub=el('ul', {cls:'tree'});
  f.m.forEach(function(m){ sub.appendChild(entryLi(m, false)); });
  sub.style.display='none'; li.appendChild(sub);
  var flip=function(){ toggle(li, sub, tog); };
  tog.addEventListener('click', flip);
  tog.addEventListener('keydown', function(ev){ if(ev.key==='Enter'||ev.key===' '){ flip(); } });
  li.setAttribute('data-ops', JSON.stringify(first.o));
  return li;
}
var tree=document.getElementById('tree'), top=el('ul', {cls:'tree'});
top.appendChild(entryLi(D.tree, true));
tree.appendChild(top);
listeners.push(function(){
  tree.querySelectorAll('li').forEach(function(li){
    var o=JSON.parse(li.getAttribute('data-ops')), any=false;
    Object.keys(o).forEach(function(p){ if(!hidden[p]){ any=true; } });
    li.firstChild.classList.toggle('dim', !any);
  });
});

/* ---------------------------------------------------------------- all rows, on demand */
function lazy(id, make){
  var d=document.getElementById(id), done=false;
  if(!d){ return; }
  d.addEventListener('toggle', function(){ if(d.open&&!done){ done=true; d.appendChild(make()); } });
}
lazy('all-ops', function(){ return table(D.rows.filter(function(r){ return r[6]===0; }), true); });
lazy('all-params', function(){ return table(D.rows.filter(function(r){ return r[6]!==0; }), true); });
applyFilter();
window.ampgraphReady=true;
})();
