# ruff: noqa
import torch as T,time
import torch.nn.functional as F
from transformers import LlamaConfig as C,LlamaForCausalLM as M
from dflash.models.layers import compile_region as cr,out_mlp,qkv,rope_of
from dflash.models.drafter import DFlashConfig as DC,DFlashDrafter as DD,apply_rope as ar,rope_cos_sin as rcs
def att(l,x,q,kc,vc,m):
 B,h,L,D=q.shape;g,S=kc.shape[1],kc.shape[2];G=h//g
 o=F.scaled_dot_product_attention(q.reshape(B,g,G*L,D),kc,vc,attn_mask=m[:,:,None].expand(B,1,G,L,S).reshape(B,1,G*L,S),scale=l.self_attn.scaling)
 return out_mlp(l,x,o.reshape(B,g,G,L,D).permute(0,3,1,2,4).reshape(B,L,-1))
def hd(n,w,x):
 z=F.linear(n(x),w).float();a=z.argmax(-1);return a,z.amax(-1)-z.masked_fill(T.arange(z.shape[-1],device=d)==a[...,None],-1e9).amax(-1)
def cf(D,x,c,s):
 cx=D.hidden_norm(D.fc(x));return [l.self_attn.context_kv(cx,(c,s)) for l in D.layers]
def dr(q,k,c,s):
 c,s=c[:,None],s[:,None];return ar(q,c,s),ar(k,c,s)
T._dynamo.config.recompile_limit=64;T.manual_seed(0);d,b='cuda',T.bfloat16
tc=C(hidden_size=576,num_hidden_layers=30,num_attention_heads=9,num_key_value_heads=3,intermediate_size=1536,vocab_size=49152,tie_word_embeddings=True)
m=M(tc).to(d,b).eval();c=DC.from_target_config(tc,5,16,49151);D=DD(c).to(d,b).eval()
for l in D.layers:l.self_attn.head_dim,l.self_attn.scaling=64,.125
P,A,H,CF=(cr(f,'inductor') for f in(qkv,att,hd,cf));E=m.model.embed_tokens;W=m.lm_head.weight;S=512
def run(ls,x,qp,co,si,rp,ks,vs,mk,rw):
 for l,k_,v_ in zip(ls,ks,vs):
  q,k,v=P(l,x,co,si,rp);k_[rw,:,qp]=k.transpose(1,2);v_[rw,:,qp]=v.transpose(1,2);x=A(l,x,q,k_,v_,mk)
 return x
with T.inference_mode():
 pa=T.arange(S,device=d);co,si=m.model.rotary_emb(T.zeros(1,1,dtype=b,device=d),pa[None]);co,si=co[0],si[0]
 dc,ds=(t[0,0] for t in rcs(pa[None],64,c.rope_theta,b))
 for N in(1,16,64):
  ks=[T.zeros(N,3,S,64,device=d,dtype=b) for _ in range(35)];vs=[T.zeros_like(t) for t in ks];rw=T.arange(N,device=d)[:,None]
  for K in(1,16):
   tok=T.randint(0,49000,(N,),device=d);pos=T.full((N,),200,device=d);kr=T.arange(K,device=d)
   def sp():
    qp=pos[:,None]+kr;ids=tok[:,None]
    if K>1:
     bk=T.full_like(qp,49151);bk[:,0]=tok;dm=(pa[None]<=qp[:,-1:])[:,None,None].expand(N,1,K,S)
     x=run(D.layers,E(bk),qp,dc[qp],ds[qp],dr,ks[30:],vs[30:],dm,rw);dd,_=H(D.norm,W,x[:,1:]);ids=T.cat([ids,dd],1)
    x=run(m.model.layers,E(ids),qp,co[qp],si[qp],rope_of(m.model.layers[0]),ks,vs,(pa[None,None]<=qp[:,:,None])[:,None],rw)
    g,_=H(m.model.norm,W,x)
    if K>1:
     n=(ids[:,1:]==g[:,:-1]).long().cumprod(1).sum(1)
     for i,(k,v) in enumerate(CF(D,x.repeat(1,1,5),dc[qp][:,None],ds[qp][:,None])):ks[30+i][rw,:,qp]=k.transpose(1,2);vs[30+i][rw,:,qp]=v.transpose(1,2)
     tok.copy_(g.gather(1,n[:,None])[:,0])
    else:tok.copy_(g[:,0])
   t0=time.time();sp();sp();T.cuda.synchronize();ct=time.time()-t0;gr=T.cuda.CUDAGraph()
   with T.cuda.graph(gr):sp()
   for _ in range(5):gr.replay()
   T.cuda.synchronize();t=time.time()
   for _ in range(100):gr.replay()
   T.cuda.synchronize();print(N,K,(time.time()-t)*10,ct)
