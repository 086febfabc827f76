import torch,time,json,os,tempfile,random as R
import sys,unittest.mock as M;sys.modules['jsonschema']=M.MagicMock()
from dflash.spec import TargetSpec as TS
from dflash.models.target import load_target,FeatureExtractor as F,layer_ids as I,hf_config as H
from dflash.models.masks import document_block_mask as BM
from dflash.train.packing import pack_row
D="cuda:0";c=torch.cuda;sy=c.synchronize;O=os.environ["OUT"];J={};p=time.perf_counter
def T(f,n=12):
 sy();a=p()
 for i in range(n):f(i)
 h=p()-a;sy();return h/n,(p()-a)/n
def W(k,v):J[k]=v;print(k,v,flush=True);json.dump(J,open(O+"/"+os.environ["P"]+".json","w"))
def rows(L,n,m,r):
 o=[];k=0;A=[]
 for _ in range(n):
  d=[];u=0
  while 1:
   x=r.randint(m//3,5*m//3)
   if u+x>L:break
   d.append((k,[r.randint(5,49000)]*x,[1]*x));u+=x;k+=1
  o.append(pack_row(d,L,0));A+=d
 return o,A
g=lambda r:(r.input_ids.to(D),r.doc_ids.to(D),r.position_ids.to(D))
d=tempfile.mkdtemp();json.dump(dict(model_type="llama",hidden_size=576,intermediate_size=1536,num_hidden_layers=30,num_attention_heads=9,num_key_value_heads=3,head_dim=64,vocab_size=49152,tie_word_embeddings=True,rope_theta=1e5,max_position_embeddings=8192),open(d+"/config.json","w"))
s=TS(d,"random","bfloat16",5,None,"on")
a=p();fx=F(load_target(s,D,num_layers=max(I(s,H(s)))+1,need_tokenizer=False,attention="flex"),compile="inductor")
rs,_=rows(8192,12,260,R.Random(0))
fx(*g(rs[0]));fx(*g(rs[1]));sy();W("load_compile_s",p()-a)
W("h2d",T(lambda i:g(rs[i])));W("mask",T(lambda i:BM(rs[i].doc_ids.to(D),_compile=True)))
ms=[BM(r.doc_ids.to(D),_compile=True) for r in rs];ip=[g(r) for r in rs]
with torch.no_grad():W("layers",T(lambda i:fx._layers(ip[i][0][None],ip[i][2][None],ms[i])))
W("sync_each_row",T(lambda i:[fx(*g(rs[i])),sy()]));W("no_sync",T(lambda i:fx(*g(rs[i]))))
st=torch.stack([rs[0].input_ids,rs[0].doc_ids,rs[0].position_ids]).to(D);f=lambda:fx(st[0],st[1],st[2])
z=c.Stream();z.wait_stream(c.current_stream())
with c.stream(z):f();f()
c.current_stream().wait_stream(z);G=c.CUDAGraph()
with c.graph(G,capture_error_mode="thread_local"):out=f()
def rp(i):r=rs[i];st.copy_(torch.stack([r.input_ids,r.doc_ids,r.position_ids]).pin_memory(),non_blocking=True);G.replay();return out.clone()
W("graph_maxdiff",max(float((rp(i).float()-fx(*g(rs[i])).float()).abs().max()) for i in range(4)))
W("graph",T(rp));W("graph_sync_each_row",T(lambda i:[rp(i),sy()]))
from torch.profiler import profile as q
with q() as P:fx(*g(rs[2]));sy()
W("kernels_per_row",sum(e.count for e in P.key_averages() if e.device_type.name=="CUDA"))
