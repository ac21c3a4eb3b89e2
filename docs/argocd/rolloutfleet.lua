-- Argo CD health check of a legorl.dev RolloutFleet (argocd-cm key
-- resource.customizations.health.legorl.dev_RolloutFleet), from its Ready, Progressing and Degraded
-- conditions: Degraded when the operator says so (crash loops, pull failures, an invalid spec, a
-- rollout past its deadline, version skew), Healthy when every replica serves (a weight sync between
-- training steps included) or the fleet is scaled to zero, Progressing while replicas come up.
-- Lua 5.1 (Argo CD's gopher-lua); tested in tests/operator/test_argocd_health.py.
local hs = {}

local function condition(type_)
  for _, c in ipairs(obj.status.conditions or {}) do
    if c.type == type_ then
      return c
    end
  end
  return nil
end

local function explain(text, c)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return text .. ": " .. c.message
  end
  return text
end

if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end
local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to reconcile generation " .. tostring(generation)
  return hs
end

local ready = condition("Ready")
local progressing = condition("Progressing")
local degraded = condition("Degraded")

if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = explain(degraded.reason or "Degraded", degraded)
elseif ready ~= nil and ready.status == "False" and ready.reason == "InvalidSpec" then
  hs.status = "Degraded"
  hs.message = explain("InvalidSpec", ready)
elseif progressing ~= nil and progressing.status == "False" and progressing.reason == "ProgressDeadlineExceeded" then
  hs.status = "Degraded"
  hs.message = explain("ProgressDeadlineExceeded", progressing)
elseif ready ~= nil and ready.status == "True" then
  if progressing ~= nil and progressing.status == "True" and progressing.reason == "RolloutInProgress" then
    hs.status = "Progressing"
    hs.message = explain("RolloutInProgress", progressing)
  else
    hs.status = "Healthy"
    hs.message = explain(ready.reason or "Ready", ready)
  end
elseif ready ~= nil and ready.reason == "ScaledToZero" then
  hs.status = "Healthy"
  hs.message = explain("ScaledToZero", ready)
else
  hs.status = "Progressing"
  if ready ~= nil then
    hs.message = explain(ready.reason or "NotReady", ready)
  else
    hs.message = "Waiting for the Ready condition"
  end
end
return hs
