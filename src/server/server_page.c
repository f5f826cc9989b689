/* GET /: a self-contained page that polls /cache/usage and draws the KV pool
 * as a grid of pages (colour = precision, label = owning request), a chart of
 * usage over time and a requantize form. No external assets. */
#include "server/server_internal.h"

#include <stdlib.h>
#include <string.h>

static const char page_html[] =
    "<!doctype html><html><head><meta charset=\"utf-8\"><title>kvserve KV cache</title>\n"
    "<style>body{font:14px sans-serif;margin:16px;background:#fafafa}h1{font-size:18px}"
    "#grid{display:flex;flex-wrap:wrap;gap:2px;max-width:960px}.pg{width:22px;height:22px;font-size:9px;"
    "display:flex;align-items:center;justify-content:center;color:#fff;border-radius:3px}"
    ".f32{background:#6a1b9a}.f16{background:#1565c0}.q8_0{background:#2e7d32}.q4_0{background:#ef6c00}"
    ".free{background:#ddd;color:#999}#legend span{display:inline-block;padding:2px 8px;margin-right:6px;color:#fff;border-radius:3px}"
    "table{border-collapse:collapse}td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}</style></head><body>\n"
    "<h1>kvserve &mdash; KV cache</h1>\n"
    "<div id=\"legend\"><span class=\"f32\">f32</span><span class=\"f16\">f16</span><span class=\"q8_0\">q8_0</span>"
    "<span class=\"q4_0\">q4_0</span><span class=\"free\">free</span></div>\n"
    "<p id=\"summary\">loading&hellip;</p>\n"
    "<canvas id=\"chart\" width=\"900\" height=\"120\" style=\"border:1px solid #ccc;background:#fff\"></canvas>\n"
    "<h2 style=\"font-size:15px\">Pages (number = request id)</h2><div id=\"grid\"></div>\n"
    "<h2 style=\"font-size:15px\">Requantize</h2>\n"
    "<form id=\"rq\" onsubmit=\"return requant()\">K <select id=\"tk\"><option>keep</option><option>f16</option>"
    "<option selected>q8_0</option><option>q4_0</option><option>f32</option></select> V <select id=\"tv\"><option>keep</option>"
    "<option>f16</option><option selected>q8_0</option><option>q4_0</option><option>f32</option></select> "
    "older than <input id=\"older\" size=\"6\" placeholder=\"all\"> tokens "
    "<label><input type=\"checkbox\" id=\"dry\"> dry run</label> <button id=\"rqbtn\">Requantize</button></form>\n"
    "<pre id=\"rqout\"></pre>\n"
    "<h2 style=\"font-size:15px\">Requests</h2><table id=\"reqs\"></table>\n"
    "<script>\n"
    "var hist=[];var key=new URLSearchParams(location.search).get('key');\n"
    "function hdr(){var h={'Content-Type':'application/json'};if(key)h['Authorization']='Bearer '+key;return h;}\n"
    "function mb(x){return (x/1048576).toFixed(2)+' MiB';}\n"
    "function draw(u){var g=document.getElementById('grid');var cells=[];var order=['q4_0','q8_0','f16','f32'];\n"
    " (u.requests||[]).forEach(function(r){if(!r.pages_k)return;order.forEach(function(t){for(var i=0;i<r.pages_k[t];i++)cells.push([t,r.id]);});});\n"
    " var free=u.page_bytes?Math.floor(u.free/u.page_bytes):0;if(free>2000)free=2000;for(var i=0;i<free;i++)cells.push(['free','']);\n"
    " g.innerHTML=cells.map(function(c){return '<div class=\"pg '+c[0]+'\" title=\"'+c[0]+(c[1]?' req '+c[1]:'')+'\">'+c[1]+'</div>';}).join('');\n"
    " document.getElementById('summary').textContent='used '+mb(u.used||0)+' of '+mb(u.budget||0)+' ('+((u.usage_ratio||0)*100).toFixed(1)+'%), '+\n"
    "  (u.n_pages||0)+' pages, '+(u.n_tokens||0)+' tokens, policy '+u.policy+', start '+u.type_k+'/'+u.type_v+', demotions '+u.demotions;\n"
    " var t='<tr><th>id</th><th>state</th><th>prompt</th><th>generated</th><th>pages</th><th>bytes</th></tr>';\n"
    " (u.requests||[]).forEach(function(r){t+='<tr><td>'+r.id+'</td><td>'+r.state+'</td><td>'+r.prompt_tokens+'</td><td>'+r.generated_tokens+\n"
    "  '</td><td>'+(r.pages||0)+'</td><td>'+(r.bytes||0)+'</td></tr>';});document.getElementById('reqs').innerHTML=t;\n"
    " hist.push(u.usage_ratio||0);if(hist.length>300)hist.shift();var c=document.getElementById('chart').getContext('2d');\n"
    " c.clearRect(0,0,900,120);c.strokeStyle='#1565c0';c.beginPath();hist.forEach(function(v,i){var x=i*3,y=115-v*110;if(i)c.lineTo(x,y);else c.moveTo(x,y);});c.stroke();\n"
    " c.fillStyle='#555';c.fillText('usage ratio over time (1 s per point)',8,12);}\n"
    "function poll(){fetch('/cache/usage',{headers:hdr()}).then(function(r){return r.json();}).then(draw).catch(function(e){\n"
    " document.getElementById('summary').textContent='error: '+e;});}\n"
    "function requant(){var b={};var tk=document.getElementById('tk').value,tv=document.getElementById('tv').value;\n"
    " if(tk!='keep')b.type_k=tk;if(tv!='keep')b.type_v=tv;var o=document.getElementById('older').value;\n"
    " if(o)b.older_than=parseInt(o);else b.scope='all';b.dry_run=document.getElementById('dry').checked;\n"
    " fetch('/cache/requantize',{method:'POST',headers:hdr(),body:JSON.stringify(b)}).then(function(r){return r.text();})\n"
    " .then(function(t){document.getElementById('rqout').textContent=t;poll();});return false;}\n"
    "poll();setInterval(poll,1000);\n"
    "</script></body></html>\n";

void server_handle_page(struct server *srv, struct reply *r)
{
    (void)srv;
    char *body = strdup(page_html);
    if (!body) {
        reply_error(r, 500, "server_error", NULL, "out of memory");
        return;
    }
    reply_text(r, 200, "text/html; charset=utf-8", body, sizeof page_html - 1);
}
